"""``HFModel``: transformers models that compute their own loss (classification, question
answering, seq2seq) train exactly and export to a folder their ``AutoModelFor...`` loads.

* a tiny BERT sequence classifier (built from a config: no download) is fine-tuned, exported from
  its checkpoint and from the module, and reloaded with ``AutoModelForSequenceClassification``:
  logits equal to the trained module's bit for bit; ``val/loss`` and ``val/accuracy`` equal a hand
  computation on the reloaded model's logits over the whole (unevenly batched) set;
* token classification and question answering: one step of 2 micro-batches holding different
  numbers of counted labels (items) has the gradient of a hand-written loss over the whole batch
  (float64, 1e-10), i.e. ``num_items`` counts what the model's loss averages over;
* seq2seq labels are counted as they are (not shifted); a causal LM is refused (``HFCausalLM``);
* ``examples/hf_text_classifier.py`` runs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re

import pytest
import torch
from test_interop import QUIET, ROOT, BertClassifier, bert_items, tiny_gpt2

import lightlike as ll
from lightlike.data import remove_unused_keys

transformers = pytest.importorskip("transformers")
from lightlike.interop import HFModel, export_hf  # noqa: E402


def tiny_bert(cls_name, dtype=torch.float32, **kw):
    """A BERT ``cls_name`` from a config (vocab 100, hidden 32, 2 layers), without dropout."""
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **kw)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).to(dtype)


class Grab(ll.Callback):
    """The wrapped model's gradients at the optimizer step."""

    def __init__(self):
        self.grads = {}

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.grads = {n: p.grad.detach().clone() for n, p in fitter.module.model.named_parameters()}


def one_step_gradient(tmp_path, model, items):
    """The gradient of one optimizer step over ``items`` in micro-batches of 2 (the last one
    shorter when ``items`` is odd)."""
    grab = Grab()
    ll.Fitter(max_steps=1, batch_size=2, grad_accum_steps=2, shuffle=False, output_dir=str(tmp_path),
              callbacks=[grab], **QUIET).fit(HFModel(model), items)
    return grab.grads


def assert_gradients_equal(grads, reference):
    expected = dict(reference.named_parameters())
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        if expected[name].grad is None:  # the pooler: no loss reaches it
            assert not g.any(), name
            continue
        torch.testing.assert_close(g, expected[name].grad, rtol=1e-10, atol=1e-12, msg=name)


def token_items(n=4, length=8):
    """Right-padded sequences whose labels are -100 on padding and on every third position (as on
    sub-word continuations), so items hold different numbers of counted labels."""
    g = torch.Generator().manual_seed(1)
    ids, lengths = torch.randint(1, 100, (n, length), generator=g), torch.tensor([8, 3, 6, 7])[:n]
    tags = torch.randint(0, 5, (n, length), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    labels = tags.masked_fill((mask == 0) | (torch.arange(length) % 3 == 2), -100)
    return [{"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def nll(logits, target, counted):
    """Hand-written cross entropy, summed over the counted targets."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * counted).sum()


def test_token_classification_step_gradient_is_the_mean_over_every_counted_label(tmp_path):
    model = tiny_bert("BertForTokenClassification", torch.float64, num_labels=5)
    reference = copy.deepcopy(model)
    items = token_items()
    batch = torch.utils.data.default_collate(items)
    counted = batch["labels"] != -100
    per_micro_batch = [int(counted[:2].sum()), int(counted[2:].sum())]
    assert per_micro_batch == [8, 9]  # uneven: a mean of the two micro-batch means would differ
    module = HFModel(model)
    assert int(module.num_items(batch)) == 17

    grads = one_step_gradient(tmp_path, model, items)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    (nll(logits, batch["labels"], counted) / counted.sum()).backward()
    assert_gradients_equal(grads, reference)

    with torch.no_grad():  # accuracy over the same counted labels, by hand
        out = module(batch)
        hits = ((out.logits.argmax(-1) == batch["labels"]) & counted).sum()
        assert module.metrics(out, batch)["accuracy"] == hits.double() / 17


def test_question_answering_step_gradient_is_the_mean_over_items(tmp_path):
    """3 items in micro-batches of 2 and 1: the loss ((start + end cross entropy) / 2, a mean
    over items) is weighted by each micro-batch's item count."""
    model = tiny_bert("BertForQuestionAnswering", torch.float64)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids, start = torch.randint(1, 100, (3, 8), generator=g), torch.tensor([1, 4, 2])
    items = [{"input_ids": ids[i], "start_positions": start[i], "end_positions": start[i] + i + 1} for i in range(3)]
    batch = torch.utils.data.default_collate(items)
    assert HFModel(model).num_items(batch) == 3

    grads = one_step_gradient(tmp_path, model, items)
    out = reference(input_ids=batch["input_ids"])
    ones = torch.ones(3)
    loss = (nll(out.start_logits, batch["start_positions"], ones) + nll(out.end_logits, batch["end_positions"], ones))
    (loss / 2 / 3).backward()
    assert_gradients_equal(grads, reference)


def test_seq2seq_labels_count_unshifted_and_a_causal_lm_is_refused():
    """A seq2seq model's loss is over its labels as they are (the decoder's inputs are shifted,
    the labels are not): num_items is their count, the loss that count's hand-written mean. A
    causal LM shifts them inside: refused, naming HFCausalLM. No labels: one error naming them.
    ``batch_keys`` are the model's forward's names: remove_unused_keys drops the rest."""
    config = transformers.T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    module = HFModel(transformers.T5ForConditionalGeneration(config).double())
    labels = torch.tensor([[5, 6, 7, 8, 1], [9, 10, 1, -100, -100]])
    batch = {"input_ids": torch.tensor([[3, 4, 5, 1], [6, 7, 1, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1],
             [1, 1, 1, 0]]), "labels": labels}
    out = module(batch)
    counted = labels != -100
    assert int(module.num_items(batch)) == 8
    torch.testing.assert_close(module.loss(out, batch), nll(out.logits, labels, counted) / 8, rtol=1e-12, atol=0)
    hits = ((out.logits.argmax(-1) == labels) & counted).sum()
    assert module.metrics(out, batch)["accuracy"] == hits.double() / 8

    kept = remove_unused_keys(module, {**batch, "idx": torch.arange(2), "text": ["a", "b"]})
    assert sorted(kept) == ["attention_mask", "input_ids", "labels"]

    unlabelled = {"input_ids": batch["input_ids"], "decoder_input_ids": labels[:, :1]}
    with pytest.raises(ll.DataError, match=r"computed no loss from a batch with keys \['decoder_input_ids', "
                                           r"'input_ids'\]: put its targets in the batch \(labels"):
        module.loss(module(unlabelled), unlabelled)
    with pytest.raises(ll.ModuleContractError, match=r"causal LM \(GPT2LMHeadModel\).*Wrap it in .*HFCausalLM"):
        HFModel(tiny_gpt2())


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    """A tiny BERT sequence classifier fine-tuned 4 steps, with its checkpoint-4."""
    out = tmp_path_factory.mktemp("classifier")
    module = HFModel(tiny_bert("BertForSequenceClassification", num_labels=3))
    fitter = ll.Fitter(max_steps=4, batch_size=4, learning_rate=1e-2, eval_every=4, save_every=4, eval_batch_size=4,
                       output_dir=str(out / "run"), seed=0, **QUIET)
    result = fitter.fit(module, bert_items(16), bert_items(11))
    return out, module.eval(), result.metrics


def test_sequence_classifier_exports_and_reloads_with_equal_logits(classifier_run):
    out, module, metrics = classifier_run
    val = torch.utils.data.default_collate(bert_items(11))
    inputs = {k: v for k, v in val.items() if k != "labels"}
    with torch.no_grad():
        trained = module.model(**inputs).logits
    for source, folder in ((out / "run" / "checkpoint-4", out / "from_checkpoint"), (module, out / "from_module")):
        export_hf(source, folder)
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["BertForSequenceClassification"] and len(config["id2label"]) == 3
        loaded = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
        assert type(loaded).__name__ == "BertForSequenceClassification"
        with torch.no_grad():
            logits = loaded(**inputs).logits
        assert torch.equal(logits, trained), folder
    # the evaluation (11 items in batches of 4, 4, 3) is the whole-set mean, by hand
    loss = torch.nn.functional.cross_entropy(logits.double(), val["labels"])
    accuracy = (logits.argmax(-1) == val["labels"]).double().mean()
    assert metrics["val/loss"] == pytest.approx(float(loss), rel=1e-6)
    assert metrics["val/accuracy"] == pytest.approx(float(accuracy), abs=1e-12)


def test_a_plain_modules_checkpoint_exports_as_its_configs_architecture(tmp_path):
    """A checkpoint of a module that is not a wrapper (no recorded class) exported with the
    pretrained model's folder as config: the model is built as the class its config.json names,
    not as a causal LM (whose weights would not fit)."""
    module = BertClassifier()
    module.model.save_pretrained(tmp_path / "pretrained")  # as a downloaded model's folder
    ll.Fitter(max_steps=1, batch_size=4, save_every=1, output_dir=str(tmp_path / "run"), **QUIET).fit(
        module, bert_items(8))
    folder = export_hf(tmp_path / "run" / "checkpoint-1", tmp_path / "hf", config=tmp_path / "pretrained")
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    trained = module.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def test_hf_text_classifier_example_runs(tmp_path, capsys):
    """In this process (transformers is imported once): trains, exports, reloads; the reloaded
    model's accuracy equals the trained one's (the example checks it) and the task is learnt."""
    spec = importlib.util.spec_from_file_location("hf_text_classifier", ROOT / "examples" / "hf_text_classifier.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--tiny", "--output-dir", str(tmp_path / "run")])
    printed = capsys.readouterr().out
    reloaded = re.search(r"exported to .*; accuracy of the reloaded model: ([0-9.]+)", printed)
    assert reloaded and float(reloaded.group(1)) >= 0.9, printed  # half the items hold the token: 0.5 by chance
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()

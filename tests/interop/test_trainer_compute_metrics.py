"""``compute_metrics(eval_pred)`` gets what ``transformers.Trainer`` gives it.

The real Trainer (eval only, on the CPU) and lightlike evaluate the same tiny model on the same
``datasets.Dataset`` in batches of 2 (of different padded lengths); the arrays each
``compute_metrics`` received are equal and so are the metrics it returned:

* a sequence classifier (BERT) on a GLUE-like set: the bare logits array, the labels,
  ``include_for_metrics`` inputs (padded with -100 across batches) and losses;
* T5, whose outputs carry a key/value cache: a (logits, encoder states) tuple, no cache;
* a causal LM with ``preprocess_logits_for_metrics`` (argmax per batch, before gathering);
* question answering: labels are the (start, end) positions' tuple, as the Trainer's.

A compute_metrics that returns a non-dict is one error naming what to return.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import lightlike as ll

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from lightlike.interop import HFCausalLM, HFModel  # noqa: E402

WORDS = "the a cat dog sat ran on mat big small red blue".split()


def tokenizer():
    """A word-level tokenizer built in memory: [PAD]=0, [UNK]=1, then WORDS."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")


TEXTS = ["the cat sat", "a dog", "the big red dog ran on a mat", "cat", "a small blue cat sat", "the mat"]


def received(into):
    """A compute_metrics as written for the Trainer: records what it gets, returns a metric."""
    def compute_metrics(eval_pred):
        into.append(eval_pred)
        predictions, labels = eval_pred[0], eval_pred[1]
        logits = predictions[0] if isinstance(predictions, tuple) else predictions
        labels = labels[0] if isinstance(labels, tuple) else labels
        hits = logits == labels if logits.ndim == labels.ndim else logits.argmax(-1) == labels
        return {"hits": float(hits[labels != -100].mean())}
    return compute_metrics


def trainer_eval(model, data, tmp_path, include=(), **kw):
    seen = []
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True,
                                          per_device_eval_batch_size=2, include_for_metrics=list(include))
    metrics = transformers.Trainer(model, args, eval_dataset=data, compute_metrics=received(seen), **kw).evaluate()
    assert len(seen) == 1
    return seen[0], metrics["eval_hits"]


def lightlike_eval(module, data, include=()):
    seen = []
    module.compute_metrics = received(seen)
    metrics = ll.Fitter(batch_size=2, include_for_metrics=list(include), loggers=[]).validate(module, data)
    assert len(seen) == 1
    return seen[0], metrics["val/hits"]


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_classifier_gets_the_bare_logits_inputs_and_losses_as_from_the_trainer(tmp_path):
    tok = tokenizer()
    data = datasets.Dataset.from_dict({"text": TEXTS, "label": [0, 1, 1, 0, 1, 0]}).map(
        lambda b: tok(b["text"]), batched=True)
    config = transformers.BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    include = ("inputs", "loss")
    want, want_hits = trainer_eval(copy.deepcopy(model), data, tmp_path, include, processing_class=tok)
    got, hits = lightlike_eval(HFModel(model, tokenizer=tok), data, include)
    assert isinstance(want.predictions, np.ndarray) and want.predictions.shape == (6, 2)  # the bare logits
    assert len(list(want)) == len(list(got)) == 4  # predictions, label_ids, inputs, losses
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    assert (got.inputs == -100).any()  # batches of different lengths, padded across with -100
    assert hits == want_hits


def test_t5_predictions_are_the_trainers_tuple_without_the_cache(tmp_path):
    tok = tokenizer()
    data = datasets.Dataset.from_dict({"input_ids": [[2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 3]],
                                       "labels": [[3, 4], [5, 6, 7], [8], [9, 10, 11, 12]]})
    config = transformers.T5Config(vocab_size=16, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    batch = {"input_ids": torch.tensor([[2, 3]]), "labels": torch.tensor([[3]])}
    with torch.no_grad():
        assert "cache" in model.eval()(**batch)  # by default the model builds its key/value cache
        assert "cache" not in HFModel(model)(batch)  # use_cache=False: none is built, nor collected
    assert "cache" not in HFModel(model).train()(batch)
    want, want_hits = trainer_eval(copy.deepcopy(model), data, tmp_path,
                                   data_collator=transformers.DataCollatorForSeq2Seq(tok))
    got, hits = lightlike_eval(HFModel(model, tokenizer=tok), data)
    assert isinstance(got.predictions, tuple) and len(got.predictions) == 2  # logits, encoder_last_hidden_state
    assert_same(got.predictions, want.predictions)
    assert_same(got.label_ids, want.label_ids)
    assert hits == want_hits


def test_a_causal_lm_with_preprocess_logits_for_metrics_as_the_trainer(tmp_path):
    tok = tokenizer()
    ids = [[2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13, 2, 3]]
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    calls = []

    def preprocess(logits, labels):
        calls.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    want, want_hits = trainer_eval(copy.deepcopy(model), data, tmp_path, preprocess_logits_for_metrics=preprocess,
                                   data_collator=transformers.DataCollatorForSeq2Seq(tok))
    trainer_calls, calls[:] = list(calls), []
    module = HFCausalLM(model, tokenizer=tok)
    module.preprocess_logits_for_metrics = preprocess
    got, hits = lightlike_eval(module, data)
    assert calls == trainer_calls == [((2, 4, 16), (2, 4)), ((2, 5, 16), (2, 5))]  # per batch, before gathering
    assert_same(got.predictions, want.predictions)
    assert got.predictions.dtype == np.int64 and got.predictions.shape == (4, 5)
    assert_same(got.label_ids, want.label_ids)
    assert hits == want_hits


def test_a_compute_metrics_returning_a_non_dict_says_what_to_return():
    module = HFModel(transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)))
    module.compute_metrics = lambda eval_pred: 0.5
    data = datasets.Dataset.from_dict({"input_ids": [[2, 3], [4, 5]], "label": [0, 1]})
    with pytest.raises(ll.errors.ModuleContractError, match=r"compute_metrics returned a float: return a dict"):
        ll.Fitter(batch_size=2, loggers=[]).validate(module, data)


def test_question_answering_labels_are_the_trainers_tuple_of_positions(tmp_path):
    """The Trainer's label names for question answering (``find_labels``): a (start, end) tuple."""
    data = datasets.Dataset.from_dict({"input_ids": [[2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13]],
                                       "start_positions": [1, 0, 2, 1], "end_positions": [2, 1, 2, 2]})
    config = transformers.BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(config)
    want, _ = trainer_eval(copy.deepcopy(model), data, tmp_path, processing_class=tokenizer())
    got, _ = lightlike_eval(HFModel(model, tokenizer=tokenizer()), data)
    assert isinstance(got.label_ids, tuple) and len(got.label_ids) == 2  # start_positions, end_positions
    assert_same(got.label_ids, want.label_ids)
    assert isinstance(got.predictions, tuple) and len(got.predictions) == 2  # start_logits, end_logits
    assert_same(got.predictions, want.predictions)

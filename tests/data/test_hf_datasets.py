"""Hugging Face ``datasets`` go straight into ``fit``/``validate``/``predict``.

* a GLUE-like tokenized ``datasets.Dataset`` (``text`` and ``label`` columns, token lists of
  different lengths, no ``set_format``) fine-tunes ``HFModel(BertForSequenceClassification)`` to
  the weights of a hand-written loop over the same batches padded by hand; ``text`` is dropped
  (logged once), ``label`` becomes ``labels``;
* kept strings reaching the model, a column nothing can batch, and variable lengths without a pad
  token are each one error naming the column and what to change; a TaskModule without
  ``batch_keys`` keeps every column; a module's ``data_collator`` collates;
* a streaming ``datasets.IterableDataset`` is reshuffled every epoch through its own
  ``set_epoch`` (each epoch's items are ``datasets``' own order for that epoch), and a run killed
  mid-epoch and resumed sees exactly the items the uninterrupted run sees; read by two DataLoader
  workers it gives every item once (``datasets`` splits it over them, lightlike does not again);
  for evaluation it is read in the main process, in order;
* on two processes (torchrun, gloo) each rank trains on ``split_dataset_by_node``'s share of a
  stream, and the predictions of a streamed and of a map-style set come back whole, in order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import StopAt  # noqa: E402
from launching import launch  # noqa: E402

import lightlike as ll  # noqa: E402

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
from lightlike.interop import HFCausalLM, HFModel  # noqa: E402

QUIET = {"loggers": [], "model_summary": False}
IDS = [[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 2], [1, 2], [1, 11, 12, 13, 14, 2], [1, 15, 2]]


def glue_like():
    """What ``dataset.map(tokenizer)`` gives for a GLUE task: text, label, token lists."""
    return datasets.Dataset.from_dict({
        "text": ["a b", "c", "d e f", "", "g h i j", "k"], "label": [0, 1, 1, 0, 1, 0], "input_ids": IDS,
        "attention_mask": [[1] * len(x) for x in IDS], "idx": list(range(6))})


def tiny_bert():
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)  # pad_token_id=0
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def padded(rows):
    """Rows padded by hand with 0 on the right, and their attention mask."""
    n = max(len(r) for r in rows)
    return (torch.tensor([r + [0] * (n - len(r)) for r in rows]),
            torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows]))


def test_a_glue_like_dataset_trains_as_a_hand_loop_over_the_same_batches(tmp_path, caplog):
    model = tiny_bert()
    reference = tiny_bert()
    caplog.set_level(logging.INFO, logger="lightlike")
    ll.Fitter(max_steps=3, batch_size=2, shuffle=False, optimizer="sgd", learning_rate=0.5, lr_scheduler="constant",
              output_dir=str(tmp_path), **QUIET).fit(HFModel(model), glue_like())
    assert caplog.text.count("dropping column(s) ['text', 'idx']") == 1
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    labels = [0, 1, 1, 0, 1, 0]
    for start in (0, 2, 4):
        ids, mask = padded(IDS[start:start + 2])
        loss = reference(input_ids=ids, attention_mask=mask, labels=torch.tensor(labels[start:start + 2])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name  # the same float32 operations, bit for bit
    assert not torch.equal(model.classifier.weight, tiny_bert().classifier.weight)  # it trained


def test_strings_kept_for_the_model_are_an_error_naming_the_column(tmp_path):
    fitter = ll.Fitter(max_steps=1, batch_size=2, remove_unused_columns=False, output_dir=str(tmp_path), **QUIET)
    with pytest.raises(ll.errors.DataError, match=r"column 'text' holds str values.*remove_unused_columns=True"):
        fitter.fit(HFModel(tiny_bert()), glue_like().remove_columns(["idx"]))


def test_a_column_nothing_can_batch_is_named_with_what_to_change(tmp_path):
    data = datasets.Dataset.from_dict({"spans": [[[0, 1], [2]], [[3], [4, 5]]], "label": [0, 1]})

    class Reads(ll.TaskModule):  # declares the column: it is kept, and cannot be batched
        batch_keys = ("spans",)

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

    with pytest.raises(ll.errors.DataError, match=r"training dataset's items cannot be batched.*'spans'.*"
                                                  r"remove_columns"):
        ll.Fitter(max_steps=1, batch_size=2, output_dir=str(tmp_path), **QUIET).fit(Reads(), data)


def test_variable_lengths_without_a_pad_token_name_what_to_give(tmp_path):
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    assert config.pad_token_id is None
    data = datasets.Dataset.from_dict({"input_ids": IDS})
    fitter = ll.Fitter(max_steps=1, batch_size=2, output_dir=str(tmp_path), **QUIET)
    with pytest.raises(ll.errors.DataError, match=r"column 'input_ids'.*different lengths.*pad_token_id"):
        fitter.fit(HFCausalLM(transformers.LlamaForCausalLM(config)), data)
    fitter = ll.Fitter(max_steps=1, batch_size=2, output_dir=str(tmp_path / "padded"), **QUIET)
    fitter.fit(HFCausalLM(transformers.LlamaForCausalLM(config), pad_token_id=0), data)  # padded: it trains
    assert fitter.state.global_step == 1


class Sees(ll.TaskModule):
    """Records the batches it is given; a linear model of the ``x`` column."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.seen = []

    def forward(self, batch):
        if self.training:
            self.seen.append(batch)
        return self.lin(batch["x"])

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch["labels"])


def test_a_task_module_without_batch_keys_keeps_every_column_and_gets_tensors(tmp_path):
    data = datasets.Dataset.from_dict({"x": [[0.5, 1.0], [2.0, -1.0]], "label": [1, 0], "text": ["a", "b"]})
    module = Sees()
    ll.Fitter(max_steps=1, batch_size=2, shuffle=False, output_dir=str(tmp_path), **QUIET).fit(module, data)
    batch = module.seen[0]
    assert sorted(batch) == ["labels", "text", "x"]
    assert batch["text"] == ["a", "b"]
    assert torch.equal(batch["x"], torch.tensor([[0.5, 1.0], [2.0, -1.0]]))
    assert torch.equal(batch["labels"], torch.tensor([1, 0]))


def test_a_modules_data_collator_collates(tmp_path):
    calls = []

    def collate(items):
        calls.append([dict(item) for item in items])
        return {"x": torch.tensor([item["x"] for item in items]), "labels": torch.tensor([1] * len(items))}

    module = Sees()
    module.data_collator = collate
    data = datasets.Dataset.from_dict({"x": [[0.5, 1.0], [2.0, -1.0]], "label": [0, 0]})
    ll.Fitter(max_steps=1, batch_size=2, shuffle=False, output_dir=str(tmp_path), **QUIET).fit(module, data)
    assert calls[-1] == [{"x": [0.5, 1.0], "label": 0}, {"x": [2.0, -1.0], "label": 0}]
    assert torch.equal(module.seen[0]["labels"], torch.tensor([1, 1]))


def table(n):
    return datasets.Dataset.from_dict({"x": [[float(i), float(-i)] for i in range(n)],
                                       "label": [i % 2 for i in range(n)], "idx": list(range(n))})


def stream(n=20):
    """A streaming dataset of 2 shards, shuffled by ``datasets`` (seed, epoch)."""
    return table(n).to_iterable_dataset(num_shards=2).shuffle(seed=7, buffer_size=8)


def seen_ids(module):
    return [int(i) for batch in module.seen for i in batch["idx"]]


def test_a_stream_is_reshuffled_every_epoch_through_its_own_set_epoch(tmp_path):
    module = Sees()
    ll.Fitter(max_steps=10, batch_size=4, output_dir=str(tmp_path), **QUIET).fit(module, stream())
    expected = []
    for epoch in (0, 1):
        data = stream()
        data.set_epoch(epoch)
        expected.append([item["idx"] for item in data])
    assert expected[0] != expected[1] and sorted(expected[0]) == list(range(20))
    assert seen_ids(module) == expected[0] + expected[1]


def test_a_stream_read_by_two_workers_gives_every_item_once(tmp_path):
    """``datasets`` splits a stream over DataLoader workers itself (a shard each): not again."""
    module = Sees()
    ll.Fitter(max_steps=6, batch_size=4, num_workers=2, output_dir=str(tmp_path), **QUIET).fit(module, stream())
    assert sorted(seen_ids(module)) == list(range(20))  # 2 workers x (4 + 4 + 2)


def test_a_streamed_evaluation_set_is_read_in_order_in_the_main_process(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lightlike")
    result = ll.Fitter(batch_size=3, num_workers=2, **QUIET).predict(Predicts(), stream(10))
    assert result.predictions.tolist() == [item["idx"] for item in stream(10)]
    assert "read in the main process (num_workers=0)" in caplog.text


def test_a_stream_killed_mid_epoch_resumes_with_the_items_of_the_uninterrupted_run(tmp_path):
    def go(out, stop=None, resume=None):
        torch.manual_seed(0)
        module = Sees()
        fitter = ll.Fitter(max_steps=9, batch_size=3, save_every=4, output_dir=str(out),
                           callbacks=[StopAt(stop)] if stop else [], **QUIET)
        with contextlib.suppress(KeyboardInterrupt):
            fitter.fit(module, stream(), resume=resume)
        return module

    reference = go(tmp_path / "ref")
    go(tmp_path / "cut", stop=6)  # checkpoint-4: 4 of epoch 0's 7 batches taken
    resumed = go(tmp_path / "cut", resume=True)
    assert seen_ids(resumed) == seen_ids(reference)[4 * 3:]  # epoch 0's rest, then epoch 1's reshuffled start
    assert torch.equal(resumed.lin.weight, reference.lin.weight)


class Predicts(Sees):
    """Predicts each item's ``idx`` (for order checks) besides its logits."""

    def predictions(self, outputs, batch):
        return batch["idx"]


def _two_process_target(out):
    """Run by torchrun: each rank writes the items it trained on and the predictions it got."""
    rank = int(os.environ["RANK"])
    module = Predicts()
    fitter = ll.Fitter(max_steps=6, batch_size=4, output_dir=str(out / "fit"), log_level="warning", **QUIET)
    fitter.fit(module, stream())
    predicted = fitter.predict(module, stream(9)).predictions.tolist()
    mapped = fitter.predict(module, table(9)).predictions.tolist()  # through lightlike's sampler
    (out / f"rank{rank}.json").write_text(json.dumps({"seen": seen_ids(module), "predicted": predicted,
                                                      "mapped": mapped}))


def test_a_stream_on_two_processes_is_split_by_node(tmp_path):
    p = launch(2, tmp_path, script=Path(__file__))
    assert p.returncode == 0, p.stderr[-4000:]
    from datasets.distributed import split_dataset_by_node

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, got in enumerate(ranks):
        expected = []
        for epoch in (0, 1):  # 10 items a rank: 3 batches an epoch, 6 steps
            share = split_dataset_by_node(stream(), rank=rank, world_size=2)
            share.set_epoch(epoch)
            expected += [item["idx"] for item in share]
        assert got["seen"] == expected
        assert got["predicted"] == [item["idx"] for item in stream(9)]  # gathered whole, in the stream's order
        assert got["mapped"] == list(range(9))
    assert sorted(ranks[0]["seen"][:10] + ranks[1]["seen"][:10]) == list(range(20))  # every item once


if __name__ == "__main__":
    _two_process_target(Path(sys.argv[1]))

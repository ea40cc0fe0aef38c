"""Evaluation is exact: item-weighted whole-set means, whole-set metrics, predictions in order."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from helpers import Classifier, DictDataset, TokenClassifier
from torch import nn

import lightlike as ll


def f1_macro(pred, y, classes=3):
    scores = []
    for c in range(classes):
        tp = ((pred == c) & (y == c)).sum().item()
        fp = ((pred == c) & (y != c)).sum().item()
        fn = ((pred != c) & (y == c)).sum().item()
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(scores) / classes


class StreamingF1:
    """Confusion-matrix F1: exact without holding predictions."""

    def __init__(self, classes=3):
        self.classes = classes
        self.reset()

    def reset(self):
        self.cm = torch.zeros(self.classes, self.classes, dtype=torch.long)

    def update(self, outputs, batch):
        idx = batch["y"] * self.classes + outputs.argmax(-1)
        self.cm += torch.bincount(idx, minlength=self.classes**2).reshape(self.classes, self.classes)

    def compute(self):
        tp = self.cm.diag().double()
        denom = 2 * tp + (self.cm.sum(0) - self.cm.diag()) + (self.cm.sum(1) - self.cm.diag())
        return torch.where(tp > 0, 2 * tp / denom, torch.zeros_like(tp)).mean()


class WithF1(Classifier):
    def metrics(self, outputs, batch):
        # float64 per-batch means: the whole-set reduction is then exact to 1e-12; a float32
        # mean carries its own rounding (~1e-7) into the reduction
        return {"accuracy": (outputs.argmax(-1) == batch["y"]).double().mean()}

    def predictions(self, outputs, batch):
        return outputs.argmax(-1)

    def compute_metrics(self, predictions, labels):
        return {"f1": f1_macro(predictions, labels)}

    def streaming_metrics(self):
        return {"f1": StreamingF1()}


def reference(model, data, loss_fn=None):
    batch = {k: torch.stack([data[i][k] for i in range(len(data))]) for k in ("x", "y", "w")}
    with torch.no_grad():
        out = model(batch)
        return {"loss": model.loss(out, batch).item(),
                "accuracy": (out.argmax(-1) == batch["y"]).double().mean().item(),
                "pred": out.argmax(-1), "y": batch["y"]}


@pytest.mark.parametrize("eval_batch_size", [1, 4, 7, 50])
def test_exact_whole_set_means(tmp_path, eval_batch_size):
    torch.manual_seed(0)
    model, data = WithF1(), DictDataset(n=23, seed=4)  # 23: never a whole number of batches
    fitter = ll.Fitter(max_steps=1, eval_batch_size=eval_batch_size, output_dir=str(tmp_path), loggers=[])
    metrics = fitter.validate(model, data)
    ref = reference(model, data)
    assert metrics["val/loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert metrics["val/accuracy"] == pytest.approx(ref["accuracy"], abs=1e-12)
    assert metrics["val/f1"] == pytest.approx(f1_macro(ref["pred"], ref["y"]))
    streamed = ll.Fitter(max_steps=1, eval_batch_size=eval_batch_size, eval_streaming=True,
                         output_dir=str(tmp_path), loggers=[]).validate(model, data)
    assert streamed["val/f1"] == pytest.approx(metrics["val/f1"], abs=1e-12)
    assert set(streamed) == set(metrics)


def test_token_weighted_loss(tmp_path):
    torch.manual_seed(0)
    model, data = TokenClassifier(), DictDataset(n=13)
    metrics = ll.Fitter(max_steps=1, eval_batch_size=4, output_dir=str(tmp_path), loggers=[]).validate(model, data)
    batch = {k: torch.stack([data[i][k] for i in range(13)]) for k in ("x", "y", "w")}
    with torch.no_grad():
        exact = model.loss(model(batch), batch).item()  # the token-weighted mean over the whole set
    assert metrics["val/loss"] == pytest.approx(exact, rel=1e-6)


def test_predict_in_order_with_labels(tmp_path):
    torch.manual_seed(0)
    model, data = WithF1(), DictDataset(n=10)
    result = ll.Fitter(max_steps=1, eval_batch_size=3, output_dir=str(tmp_path), loggers=[]).predict(model, data)
    ref = reference(model, data)
    assert torch.equal(result.predictions, ref["pred"])
    assert torch.equal(result.labels, ref["y"])
    assert result.metrics["predict/accuracy"] == pytest.approx(ref["accuracy"])


def test_several_eval_sets_and_test(tmp_path):
    torch.manual_seed(0)
    model = Classifier()
    val, ood = DictDataset(n=9, seed=1), DictDataset(n=5, seed=2)
    r = ll.Fitter(max_steps=2, batch_size=4, eval_every=1, output_dir=str(tmp_path), loggers=[],
                  learning_rate=0.0).fit(model, DictDataset(n=8), {"val": val, "ood": ood})
    assert {"val/loss", "val/accuracy", "ood/loss", "ood/accuracy", "train/loss"} <= set(r.metrics)
    assert r.metrics["ood/loss"] == pytest.approx(reference(model, ood)["loss"], rel=1e-6)
    t = ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[]).test(model, ood)
    assert t["test/loss"] == pytest.approx(r.metrics["ood/loss"])


def test_eval_does_not_change_training(tmp_path):
    """Evaluating must not perturb the trained weights: no random stream training draws from
    (torch's, numpy's, Python's) moves, whatever evaluation draws. numpy and Python's were
    perturbed by a validation set that samples (a shared dataset class with jitter)."""
    import random

    import numpy as np

    class Noisy(Classifier):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, batch):
            x = batch["x"]
            if self.training:  # training draws from every stream
                x = x + 0.01 * torch.as_tensor(np.random.normal(size=tuple(x.shape)), dtype=x.dtype) + 0.01 * random.random()
            return self.net(self.drop(x))

    class Jittered(DictDataset):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {**item, "x": item["x"] + 1e-3 * (np.random.rand() + random.random())}

    def run(eval_every, val=None):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        m = Noisy()
        kw = dict(eval_every=eval_every) if eval_every else {}
        ll.Fitter(max_steps=6, batch_size=4, output_dir=str(tmp_path / str(len(list(tmp_path.iterdir())))),
                  loggers=[], **kw).fit(m, DictDataset(n=24), val)
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    reference = run(None)
    assert torch.equal(reference, run(2, DictDataset(n=8)))
    assert torch.equal(reference, run(2, Jittered(n=8)))
    # a DataLoader of the user's draws its base seed from the global generator at every iter()
    assert torch.equal(reference, run(2, torch.utils.data.DataLoader(Jittered(n=8), batch_size=4)))


# -- unlabelled data, missing keys, streaming fallback, variable lengths -------------------------------

class Unlabelled(torch.utils.data.Dataset):
    """DictDataset's features without its labels: what predict is for."""

    def __init__(self, n):
        self.data = DictDataset(n=n)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"x": self.data[i]["x"]}


def test_predict_on_unlabelled_data(tmp_path):
    """labels(batch) is None: predictions only, labels None, no loss and no metrics (the loss
    would read batch['y']); validate on the same data names the key, the hook and the batch's keys."""
    torch.manual_seed(0)
    model, data = WithF1(), Unlabelled(10)
    fitter = ll.Fitter(max_steps=1, eval_batch_size=3, output_dir=str(tmp_path), loggers=[])
    result = fitter.predict(model, data)
    assert torch.equal(result.predictions, reference(model, data.data)["pred"])
    assert result.labels is None and result.metrics == {}
    with pytest.raises(ll.DataError, match=r"loss\(\) read batch key 'y' in val batch 0.*has keys \['x'\]"):
        fitter.validate(model, data)


def test_missing_key_in_metrics_and_loss_is_a_data_error(tmp_path):
    from lightlike.evaluation import call_loss

    class ReadsW(Classifier):
        def metrics(self, outputs, batch):
            return {"w": batch["weight"].double().mean()}

    data = DictDataset(n=5)
    fitter = ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[])
    with pytest.raises(ll.DataError, match=r"metrics\(\) read batch key 'weight' in val batch 0.*\['w', 'x', 'y'\]"):
        fitter.validate(ReadsW(), data)
    # the helper the training step uses for the loss: the same error, with the step named
    batch = {"x": torch.randn(2, 8)}
    model = Classifier()
    with pytest.raises(ll.DataError, match=r"loss\(\) read batch key 'y' at step 3, micro-batch 1"):
        call_loss(model, model(batch), batch, "at step {}, micro-batch {}", 3, 1)
    ok = {"x": torch.randn(2, 8), "y": torch.tensor([0, 1])}
    loss = call_loss(model, model(ok), ok, "at step {}", 1)
    assert torch.equal(loss, model.loss(model(ok), ok))


def test_own_key_error_is_not_blamed_on_the_batch(tmp_path):
    """A KeyError from the module's own dict is re-raised as it is, not reported as a batch key."""
    class Table(Classifier):
        def __init__(self):
            super().__init__()
            self.table = {"a": 1}

        def forward(self, batch):
            return self.net(batch["x"]) * self.table["b"]

    with pytest.raises(KeyError) as info:
        ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[]).validate(Table(), DictDataset(n=4))
    assert type(info.value) is KeyError and info.value.args == ("b",)

    class Encoder(torch.nn.Module):
        label2id = {"a": 0}

    class Nested(Classifier):  # a dict on a submodule, one nested in the module's own, a raise
        def __init__(self, how):
            super().__init__()
            self.enc, self.t, self.how = Encoder(), {"a": {}}, how

        def forward(self, batch):
            if self.how == "submodule":
                return self.net(batch["x"]) * self.enc.label2id["b"]
            if self.how == "nested":
                return self.net(batch["x"]) * self.t["a"]["q"]
            raise KeyError("config entry 'foo'")

    for how in ("submodule", "nested", "raise"):
        with pytest.raises(KeyError) as info:
            ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[]).validate(Nested(how), DictDataset(n=4))
        assert type(info.value) is KeyError, how

    class ReadsZ(Classifier):
        def forward(self, batch):
            return self.net(batch["z"])

    with pytest.raises(ll.DataError, match=r"the module read batch key 'z' in val batch 0"):
        ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[]).validate(ReadsZ(), DictDataset(n=4))

    # a batch class with its own __getitem__ (like HF's BatchEncoding), and a copy of the batch
    # (DDP on CUDA moves it into a new dict): still the batch's missing key
    from collections import UserDict

    from lightlike.evaluation import call_module

    class Copying(ReadsZ):
        def forward(self, batch):
            return super().forward(dict(batch))

    for model, batch in ((ReadsZ(), UserDict(x=torch.randn(2, 8))), (Copying(), {"x": torch.randn(2, 8)})):
        with pytest.raises(ll.DataError, match=r"the module read batch key 'z' here.*has keys \['x'\]"):
            call_module(model, batch, "here")


def test_eval_streaming_without_streaming_metrics_keeps_compute_metrics(tmp_path, caplog):
    """eval_streaming=True on a module with compute_metrics only: the outputs are held for
    compute_metrics (never silently dropped), with one warning saying what to change."""
    class OnlyWhole(WithF1):
        streaming_metrics = ll.TaskModule.streaming_metrics

    torch.manual_seed(0)
    model, data = OnlyWhole(), DictDataset(n=23, seed=4)
    ref = reference(model, data)
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        for _ in range(2):
            m = ll.Fitter(max_steps=1, eval_batch_size=4, eval_streaming=True, output_dir=str(tmp_path),
                          loggers=[]).validate(model, data)
            assert m["val/f1"] == pytest.approx(f1_macro(ref["pred"], ref["y"]))
    warnings = [r.getMessage() for r in caplog.records if "eval_streaming=True" in r.getMessage()]
    assert len(warnings) == 1 and "define streaming_metrics()" in warnings[0].lower()


class VarLen(torch.utils.data.Dataset):
    """Item i is a sequence of 1 + i % 4 tokens (8 features each) with a class per token."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.items = [(torch.randn(1 + i % 4, 8, generator=g), torch.randint(0, 3, (1 + i % 4,), generator=g))
                      for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(items):
    """Pads each batch to its longest sequence: x with 0, y with -100."""
    t = max(len(x) for x, _ in items)
    x = torch.zeros(len(items), t, 8)
    y = torch.full((len(items), t), -100)
    for i, (xi, yi) in enumerate(items):
        x[i, :len(xi)], y[i, :len(yi)] = xi, yi
    return {"x": x, "labels": y}


class Tagger(Classifier):
    seen: list = []

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())

    def num_items(self, batch):
        return (batch["labels"] != -100).sum()

    def metrics(self, outputs, batch):
        return {}

    def predictions(self, outputs, batch):
        return torch.where(batch["labels"] != -100, outputs.argmax(-1), -100)

    def compute_metrics(self, predictions, labels):
        self.seen.append((predictions, labels))
        real = labels != -100
        return {"token_accuracy": (predictions[real] == labels[real]).double().mean()}


def test_variable_length_predictions_are_padded(tmp_path):
    """Batches of different sequence lengths: whole-set predictions and labels are padded with
    -100 to the longest, in dataset order (HF Trainer parity), for compute_metrics and predict."""
    torch.manual_seed(0)
    model, data = Tagger(), VarLen(9)
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=pad_collate)  # lengths 2, 4, 4, 4, 1
    fitter = ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[])
    result = fitter.predict(model, loader)
    want_pred = torch.full((9, 4), -100)
    want_y = torch.full((9, 4), -100)
    correct = total = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(data.items):
            p = model.net(x).argmax(-1)
            want_pred[i, :len(p)], want_y[i, :len(y)] = p, y
            correct, total = correct + (p == y).sum().item(), total + len(y)
    assert torch.equal(result.predictions, want_pred) and torch.equal(result.labels, want_y)
    assert result.metrics["predict/token_accuracy"] == pytest.approx(correct / total, abs=1e-12)
    m = fitter.validate(model, loader)
    assert m["val/token_accuracy"] == pytest.approx(correct / total, abs=1e-12)
    assert torch.equal(model.seen[-1][0], want_pred)


class TokenMetricTagger(Tagger):
    """A per-batch token accuracy among ``metrics()``: the mean over the batch's real tokens,
    with ``num_items`` their number, so the whole-set value weights each batch by its tokens."""

    def metrics(self, outputs, batch):
        real = batch["labels"] != -100
        return {"token_acc": (outputs.argmax(-1)[real] == batch["labels"][real]).double().mean()}


def token_reference(model, data):
    """(whole-set token accuracy, whole-set mean token cross-entropy), by hand, token by token."""
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in data.items:
            out = model.net(x)
            correct, total = correct + (out.argmax(-1) == y).sum().item(), total + len(y)
            loss += nn.functional.cross_entropy(out.double(), y, reduction="sum").item()
    return correct / total, loss / total


@pytest.mark.parametrize("eval_batch_size", [2, 3])
def test_a_metric_is_weighted_by_num_items_not_by_rows(tmp_path, eval_batch_size):
    """A metric other than the loss is reduced as the loss is: each batch's mean weighted by its
    ``num_items`` (here its real, unpadded tokens), divided once by the set's tokens. Per-row or
    per-batch weights give another value on these batches (1-4 real tokens per row)."""
    torch.manual_seed(0)
    model, data = TokenMetricTagger(), VarLen(9)
    loader = torch.utils.data.DataLoader(data, batch_size=eval_batch_size, collate_fn=pad_collate)
    metrics = ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[]).validate(model, loader)
    accuracy, loss = token_reference(model, data)
    # the reference differs from the per-batch and per-row means here, so the check can tell them apart
    batches = [pad_collate(data.items[s:s + eval_batch_size]) for s in range(0, 9, eval_batch_size)]
    with torch.no_grad():
        per_batch = [model.metrics(model(b), b)["token_acc"].item() for b in batches]
    rows = [len(b["labels"]) for b in batches]
    assert abs(sum(per_batch) / len(per_batch) - accuracy) > 1e-3
    assert abs(sum(a * r for a, r in zip(per_batch, rows, strict=True)) / 9 - accuracy) > 1e-3
    assert metrics["val/token_acc"] == pytest.approx(accuracy, abs=1e-12)
    assert metrics["val/token_accuracy"] == pytest.approx(accuracy, abs=1e-12)  # compute_metrics, whole set
    assert metrics["val/loss"] == pytest.approx(loss, rel=1e-6)


def test_predict_on_tuple_batches_still_reports_metrics(tmp_path):
    """The default labels() reads mapping batches only; a tuple batch counts as labelled, so
    predict computes the loss and metrics as validate does."""
    class Pairs(torch.utils.data.Dataset):
        def __init__(self):
            self.data = DictDataset(n=6)

        def __len__(self):
            return 6

        def __getitem__(self, i):
            item = self.data[i]
            return item["x"], item["y"]

    class TupleClassifier(Classifier):
        def forward(self, batch):
            return self.net(batch[0])

        def loss(self, outputs, batch):
            return torch.nn.functional.cross_entropy(outputs, batch[1])

        def metrics(self, outputs, batch):
            return {}

    fitter = ll.Fitter(max_steps=1, output_dir=str(tmp_path), loggers=[])
    model = TupleClassifier()
    result = fitter.predict(model, Pairs())
    assert result.metrics["predict/loss"] == pytest.approx(fitter.validate(model, Pairs())["val/loss"])


def test_metric_keys_that_change_between_batches_are_refused(tmp_path):
    """A metric some batches leave out would be averaged over the wrong items (over the full
    batches only, or counted as 0 elsewhere): an error naming the keys instead."""
    class FullBatchesOnly(Classifier):
        def metrics(self, outputs, batch):
            extra = {"extra": outputs.new_ones(())} if len(batch["y"]) == 4 else {}
            return {**super().metrics(outputs, batch), **extra}

    fitter = ll.Fitter(max_steps=1, batch_size=4, output_dir=str(tmp_path), loggers=[])
    with pytest.raises(ll.ModuleContractError, match=r"metrics\(\) returned keys \['accuracy'\] .*but "
                                                     r"\['accuracy', 'extra'\] before; return the same keys"):
        fitter.validate(FullBatchesOnly(), DictDataset(n=10))


def test_an_eval_set_named_train_is_refused(tmp_path):
    """Its train/loss would be logged beside the training loss under the same key."""
    fitter = ll.Fitter(max_steps=2, batch_size=4, eval_every=1, output_dir=str(tmp_path), loggers=[])
    with pytest.raises(ll.DataError, match="may not be named 'train'.*name it e.g. 'train_eval'"):
        fitter.fit(Classifier(), DictDataset(n=8), {"val": DictDataset(n=4), "train": DictDataset(n=8)})


def test_tuple_predictions_are_joined_field_by_field(tmp_path):
    """(ids, ids * 10) per batch came back as a flat list of per-batch chunks, fields alternating;
    now a tuple of two joined tensors (a namedtuple keeps its type), as HF's nested_concat gives."""
    import collections

    Pair = collections.namedtuple("Pair", "ids tens")

    class Pairs(Classifier):
        def predictions(self, outputs, batch):
            ids = torch.arange(len(batch["y"])) + 100 * len(batch["y"])
            return Pair(ids, ids * 10) if self.named else (ids, ids * 10)

    fitter = ll.Fitter(max_steps=1, eval_batch_size=2, output_dir=str(tmp_path), loggers=[])
    for named in (False, True):
        module = Pairs()
        module.named = named
        got = fitter.predict(module, DictDataset(n=5)).predictions
        assert type(got) is (Pair if named else tuple)
        want = torch.tensor([200, 201, 200, 201, 100])
        assert torch.equal(got[0], want) and torch.equal(got[1], want * 10)


def test_a_per_batch_scalar_in_a_tuple_prediction_is_refused(tmp_path):
    """A Hugging Face (loss, logits) tuple (return_dict=False): the loss is one value per batch,
    which was joined as if it were one row per item (interleaved with items on several
    processes). A mapping leaves such a field out (test_interop); in a tuple that would move the
    logits to position 0, so it is refused, naming the fix."""
    from lightlike.errors import ModuleContractError

    class LossAndLogits(Classifier):
        def predictions(self, outputs, batch):
            return (nn.functional.cross_entropy(outputs, batch["y"]), outputs)

    fitter = ll.Fitter(max_steps=1, eval_batch_size=2, output_dir=str(tmp_path), loggers=[])
    with pytest.raises(ModuleContractError, match=r"predictions\(\)\[0\] is a 0-d tensor .*outputs\[1:\]"):
        fitter.predict(LossAndLogits(), DictDataset(n=5))


def test_mapping_predictions_keep_every_field_and_their_type(tmp_path):
    """A field squeezed to 0-d on a batch of one item is that item's row (a first version of the
    per-batch-loss rule dropped it from that batch: KeyError, or the field gone); a mapping type
    the module returns comes back; a user's own {"loss": scalar, ...} is refused, naming it."""
    import collections

    from lightlike.errors import ModuleContractError

    class Squeezed(Classifier):
        def predictions(self, outputs, batch):
            return collections.OrderedDict(pred=outputs[:, 0:1].squeeze(), emb=outputs)

    class WithLoss(Classifier):
        def predictions(self, outputs, batch):
            return {"loss": nn.functional.cross_entropy(outputs, batch["y"]), "logits": outputs}

    data = DictDataset(n=5)
    module = Squeezed()
    with torch.no_grad():
        reference = module({"x": data.x})
    for batch_size in (1, 2, 4):  # a last batch of one item; every batch one item
        fitter = ll.Fitter(max_steps=1, eval_batch_size=batch_size, output_dir=str(tmp_path / str(batch_size)), loggers=[])
        got = fitter.predict(module, data).predictions
        assert type(got) is collections.OrderedDict and list(got) == ["pred", "emb"]
        torch.testing.assert_close(got["emb"], reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["pred"], reference[:, 0], rtol=0, atol=1e-6)
    with pytest.raises(ModuleContractError, match=r"predictions\(\)\['loss'\] is a 0-d tensor"):
        ll.Fitter(max_steps=1, eval_batch_size=2, output_dir=str(tmp_path / "loss"), loggers=[]).predict(WithLoss(), data)

    class Nested(Classifier):  # the same per-batch value one level down (it became one row per batch)
        def predictions(self, outputs, batch):
            return {"head": (nn.functional.cross_entropy(outputs, batch["y"]), outputs), "ids": batch["y"]}

    with pytest.raises(ModuleContractError, match=r"predictions\(\)\['head'\]\[0\] is a 0-d tensor"):
        ll.Fitter(max_steps=1, eval_batch_size=2, output_dir=str(tmp_path / "nested"), loggers=[]).predict(Nested(), data)
    got = ll.Fitter(max_steps=1, eval_batch_size=1, output_dir=str(tmp_path / "nested1"), loggers=[]).predict(
        Nested(), data).predictions  # batches of one item: the 0-d field is each item's row
    assert got["head"][0].shape == (5,) and torch.equal(got["ids"], data.y)


@dataclasses.dataclass(frozen=True)
class Scored:
    """A prediction record: per-item fields, one derived (``init=False``) and one transformed by
    ``__post_init__``, which must run once per batch (not again on the joined fields)."""

    label: torch.Tensor
    logits: torch.Tensor
    names: list
    top: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "top", self.logits.max(-1).values)
        object.__setattr__(self, "label", self.label + 1000)


class Records(Classifier):
    def predictions(self, outputs, batch):
        rec = Scored(outputs.argmax(-1), outputs, [f"item{int(y)}" for y in batch["y"]])
        return {"rec": rec, "y": batch["y"]} if self.nested else rec


def test_dataclass_predictions_are_joined_field_by_field(tmp_path):
    """A dataclass of per-item fields came back as a list of one object per batch; now one
    object of its type whose fields are joined over the set (at any depth, init=False fields
    too), as a mapping's values are. A 0-d field beside rows is refused by its name."""
    from lightlike.errors import ModuleContractError

    data = DictDataset(n=5)
    module = Records()
    with torch.no_grad():
        logits = module({"x": data.x})
    for nested in (False, True):
        module.nested = nested
        got = ll.Fitter(max_steps=1, eval_batch_size=2, output_dir=str(tmp_path / str(nested)),
                        loggers=[]).predict(module, data).predictions
        rec = got["rec"] if nested else got
        assert type(rec) is Scored
        torch.testing.assert_close(rec.logits, logits, rtol=0, atol=1e-6)
        assert torch.equal(rec.label, logits.argmax(-1) + 1000) and rec.names == [f"item{int(y)}" for y in data.y]
        torch.testing.assert_close(rec.top, logits.max(-1).values, rtol=0, atol=1e-6)
        if nested:
            assert torch.equal(got["y"], data.y)

    class PerBatch(Classifier):
        def predictions(self, outputs, batch):
            return Scored(outputs.sum(), outputs, [])

    with pytest.raises(ModuleContractError, match=r"predictions\(\)\.label is a 0-d tensor"):
        ll.Fitter(max_steps=1, eval_batch_size=2, output_dir=str(tmp_path / "scalar"), loggers=[]).predict(
            PerBatch(), data)


def test_evaluation_gives_the_module_back_through_its_own_train(tmp_path):
    """A module whose train() override switches training-only behaviour: after an evaluation
    its train(True) runs again (setting the flags back only skipped it, and the run trained on
    with the behaviour off); a submodule frozen in eval mode stays so."""
    seen = []

    class Noisy(Classifier):
        def __init__(self):
            super().__init__()
            self.noise = True
            self.frozen = nn.BatchNorm1d(8).eval()

        def train(self, mode=True):
            super().train(mode)
            self.noise = mode
            self.frozen.eval()  # the module keeps its norm frozen, as fine-tuning code does
            return self

        def forward(self, batch):
            if self.training:
                seen.append((self.noise, self.frozen.training))
            return self.net(self.frozen(batch["x"]))

    module = Noisy()
    ll.Fitter(max_steps=4, batch_size=4, eval_every=2, output_dir=str(tmp_path), loggers=[]).fit(
        module, DictDataset(n=16), DictDataset(n=4))
    assert seen == [(True, False)] * 4
    module.frozen.train()  # now a mode the override would not set: kept as it was too
    ll.Fitter(max_steps=1, output_dir=str(tmp_path / "b"), loggers=[]).validate(module, DictDataset(n=4))
    assert module.training and module.noise and module.frozen.training

"""Evaluation is exact: item-weighted whole-set means, whole-set metrics, predictions in order."""

from __future__ import annotations

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
    """Evaluating (in eval mode, no grad, no RNG use) must not perturb the trained weights."""
    class Dropout(Classifier):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, batch):
            return self.net(self.drop(batch["x"]))

    def run(eval_every):
        torch.manual_seed(0)
        m = Dropout()
        kw = dict(eval_every=eval_every) if eval_every else {}
        ll.Fitter(max_steps=6, batch_size=4, output_dir=str(tmp_path / str(eval_every)), loggers=[], **kw
                  ).fit(m, DictDataset(n=24), DictDataset(n=8) if eval_every else None)
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    assert torch.equal(run(None), run(2))

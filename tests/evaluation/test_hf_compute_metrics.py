"""An HF Trainer compute_metrics(eval_pred), written with numpy, runs unchanged: as a method, or set
on the module as the Trainer takes it; it gets numpy arrays, the whole set's, in dataset order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightlike as ll
from tests.helpers import Classifier, DictDataset

seen: list = []


def hf_compute_metrics(eval_pred):
    """As written for transformers.Trainer(compute_metrics=...)."""
    predictions, label_ids = eval_pred.predictions, eval_pred.label_ids
    seen.append((type(predictions), type(label_ids), predictions.shape, label_ids.shape))
    return {"hf_accuracy": (np.argmax(predictions, -1) == label_ids).mean()}


class HFStyle(Classifier):
    def compute_metrics(self, eval_pred):
        logits, labels = eval_pred  # unpacked, as HF's EvalPrediction allows
        return {"hf_accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


@pytest.fixture(scope="module")
def expected():
    """The accuracy of the Classifier's predictions on 23 items, by hand."""
    torch.manual_seed(0)
    module, data = Classifier(), DictDataset(23)
    with torch.no_grad():
        return (module(data[:]).argmax(-1) == data.y).double().mean().item()


def test_a_method_taking_eval_pred_gets_numpy_arrays(expected):
    torch.manual_seed(0)
    metrics = ll.Fitter(batch_size=5, loggers=[]).validate(HFStyle(), DictDataset(23))
    assert metrics["val/hf_accuracy"] == pytest.approx(expected, rel=1e-12)
    assert metrics["val/hf_accuracy"] == pytest.approx(metrics["val/accuracy"], rel=1e-6)  # the per-batch mean


def test_a_function_set_on_the_module_as_the_trainer_takes_it(expected):
    torch.manual_seed(0)
    module = Classifier()
    module.compute_metrics = hf_compute_metrics
    seen.clear()
    metrics = ll.Fitter(batch_size=5, loggers=[]).validate(module, DictDataset(23))
    assert metrics["val/hf_accuracy"] == pytest.approx(expected, rel=1e-12)
    assert seen == [(np.ndarray, np.ndarray, (23, 3), (23,))]  # once, at the end: the whole set

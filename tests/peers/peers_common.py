"""The HF Trainer tests' regression task (transformers tests/trainer/test_trainer.py:
``RegressionDataset``, ``RegressionModel``, ``AlmostAccuracy``) and Lightning's ``BoringModel``,
as lightlike modules, for the ported tests in this folder."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import lightlike as ll

QUIET = {"loggers": [], "progress_bar": False, "model_summary": False, "log_level": "warning"}


class RegressionDataset:
    """y = a * x + b + noise, as test_trainer.py draws it (numpy's global seed 42)."""

    def __init__(self, a=2.0, b=3.0, length=64, seed=42, label_names=("labels",)):
        np.random.seed(seed)
        self.label_names = list(label_names)
        self.x = np.random.normal(size=(length,)).astype(np.float32)
        self.ys = [(a * self.x + b + np.random.normal(scale=0.1, size=(length,))).astype(np.float32)
                   for _ in self.label_names]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        item = {name: y[i] for name, y in zip(self.label_names, self.ys, strict=True)}
        item["input_x"] = self.x[i]
        return item


class RegressionModel(ll.TaskModule):
    """``y = a * x + b`` with the mean squared error; ``double_output`` returns ``(y, y)``."""

    def __init__(self, a=0.0, b=0.0, double_output=False):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))
        self.double_output = double_output

    def forward(self, batch):
        y = batch["input_x"] * self.a + self.b
        return (y, y) if self.double_output else y

    def loss(self, outputs, batch):
        y = outputs[0] if self.double_output else outputs
        return nn.functional.mse_loss(y, batch["labels"])


class AlmostAccuracy:
    """The share of predictions within ``thresh`` of their label (an HF ``compute_metrics``)."""

    def __init__(self, thresh=0.25):
        self.thresh = thresh

    def __call__(self, eval_pred):
        predictions, labels = eval_pred
        true = np.abs(predictions - labels) <= self.thresh
        return {"accuracy": true.astype(np.float32).mean().item()}


def regression_fitter(tmp_path, *, callbacks=None, **kwargs):
    """``get_regression_trainer`` with ``TrainingArguments``' defaults: 3 epochs, batch 8, lr 5e-5
    unless given, the linear schedule, AdamW, seed 42, gradients clipped at a norm of 1.0."""
    fields = {"output_dir": str(tmp_path), "max_epochs": 3, "batch_size": 8, "learning_rate": 5e-5,
              "seed": 42, "max_grad_norm": 1.0, **QUIET}
    fields.update(kwargs)
    return ll.Fitter(callbacks=callbacks, **fields)


class RandomDataset(torch.utils.data.Dataset):
    """Lightning's ``RandomDataset(size, length)``: standard normal rows."""

    def __init__(self, size=32, length=64, seed=0):
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class BoringModel(ll.TaskModule):
    """Lightning's ``BoringModel``: one ``Linear(32, 2)``, the mean squared error to ones, SGD at
    lr 0.1."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, batch):
        return self.layer(batch)

    def loss(self, outputs, batch):
        return nn.functional.mse_loss(outputs, torch.ones_like(outputs))

    def configure_optimizers(self, config):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def boring_fitter(tmp_path, *, callbacks=None, **kwargs):
    """Lightning's ``Trainer`` defaults as far as they carry over: batch size 1 (BoringModel's
    loaders), no clipping, a constant rate (its optimizer has no scheduler)."""
    fields = {"output_dir": str(tmp_path), "batch_size": 1, "shuffle": False, "lr_scheduler": "constant",
              "save_strategy": "no", **QUIET}
    fields.update(kwargs)
    return ll.Fitter(callbacks=callbacks, **fields)

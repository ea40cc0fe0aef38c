"""The HF schedules' own expected learning rates (transformers
tests/optimization/test_optimization.py::ScheduleInitTest::test_schedulers: AdamW at lr 10, 10
steps, 2 of warmup) and test_trainer.py's schedule tests, read off a lightlike fit: the rate
each optimizer step used."""

from __future__ import annotations

import pytest
import torch
from peers_common import QUIET, RegressionDataset
from torch import nn

import lightlike as ll


class Still(ll.TaskModule):
    """A zero gradient: the weights stay put whatever the learning rate."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        return batch["input_x"] * self.w * 0.0

    def loss(self, outputs, batch):
        return outputs.mean()


class RatesUsed(ll.Callback):
    def __init__(self):
        self.rates = []

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.rates.append(optimizer.param_groups[0]["lr"])


def _rates(tmp_path, **fields):
    seen = RatesUsed()
    fields = {"output_dir": str(tmp_path), "max_steps": 10, "batch_size": 8, "learning_rate": 10.0,
              "warmup_steps": 2, **QUIET, **fields}
    fitter = ll.Fitter(callbacks=[seen], **fields)
    fitter.fit(Still(), RegressionDataset())
    return seen.rates, fitter


SCHEDULES = {
    "constant": ({"warmup_steps": 0}, [10.0] * 10),
    "constant_with_warmup": ({"warmup_steps": 4}, [0.0, 2.5, 5.0, 7.5, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]),
    "linear": ({}, [0.0, 5.0, 10.0, 8.75, 7.5, 6.25, 5.0, 3.75, 2.5, 1.25]),
    "cosine": ({}, [0.0, 5.0, 10.0, 9.61, 8.53, 6.91, 5.0, 3.08, 1.46, 0.38]),
    "cosine_with_restarts": ({"num_cycles": 2}, [0.0, 5.0, 10.0, 8.53, 5.0, 1.46, 10.0, 8.53, 5.0, 1.46]),
    "polynomial": ({"power": 2.0, "lr_end": 1e-7}, [0.0, 5.0, 10.0, 7.656, 5.625, 3.906, 2.5, 1.406, 0.625, 0.156]),
    "inverse_sqrt": ({}, [0.0, 5.0, 10.0, 8.165, 7.071, 6.325, 5.774, 5.345, 5.0, 4.714]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedulers(tmp_path, name):
    """transformers tests/optimization/test_optimization.py::ScheduleInitTest::test_schedulers
    (inverse_sqrt's numbers as transformers 5.25's get_inverse_sqrt_schedule gives them): the
    expected rates within 1e-2."""
    fields, expected = SCHEDULES[name]
    rates, _ = _rates(tmp_path, lr_scheduler=name, **fields)
    assert rates == pytest.approx(expected, abs=1e-2)


def test_schedulers_save_and_reload(tmp_path):
    """transformers tests/optimization/test_optimization.py::ScheduleInitTest::test_schedulers
    (``unwrap_and_save_reload_schedule``): a schedule saved and reloaded half-way gives the same
    rates as one run straight through."""
    from helpers import StopAt

    straight, _ = _rates(tmp_path / "straight", lr_scheduler="cosine")
    fields = {"output_dir": str(tmp_path / "resumed"), "max_steps": 10, "batch_size": 8, "learning_rate": 10.0,
              "warmup_steps": 2, "lr_scheduler": "cosine", "save_every": 5, **QUIET}
    with pytest.raises(KeyboardInterrupt):
        ll.Fitter(callbacks=[StopAt(7)], **fields).fit(Still(), RegressionDataset())
    seen = RatesUsed()
    ll.Fitter(callbacks=[seen], **fields).fit(Still(), RegressionDataset(), resume=True)
    assert seen.rates == straight[5:]


def test_cosine_with_min_lr_scheduler(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_cosine_with_min_lr_scheduler:
    lr 0.2, 10 steps, 2 of warmup, min_lr 1e-5: the last learning rate is 1e-5."""
    _, fitter = _rates(tmp_path, lr_scheduler="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-5},
                       learning_rate=0.2)
    assert fitter.scheduler.get_last_lr()[0] == pytest.approx(1e-5, rel=1e-12)


def test_warmup_ratio(tmp_path):
    """transformers tests/trainer/test_trainer.py (``get_warmup_steps``: ceil(warmup_ratio * steps)):
    warmup_ratio 0.2 of 10 steps is the 2 steps of warmup above."""
    rates, _ = _rates(tmp_path, lr_scheduler="linear", warmup_steps=0, warmup_ratio=0.2)
    assert rates == pytest.approx(SCHEDULES["linear"][1], abs=1e-2)

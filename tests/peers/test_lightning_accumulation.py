"""Lightning's gradient accumulation tests (lightning tests/tests_pytorch/), ported: how many
optimizer steps a run with ``accumulate_grad_batches`` (``grad_accum_steps``) takes, and that a
short last window still steps."""

from __future__ import annotations

import math

import pytest
import torch
from peers_common import BoringModel, RandomDataset, boring_fitter

import lightlike as ll


class Steps(ll.Callback):
    """The weights after each optimizer step, and how many steps zeroed the gradients."""

    def __init__(self):
        self.weights, self.optimizer_steps = [], 0

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.optimizer_steps += 1

    def on_step_end(self, fitter, state, control):
        self.weights.append(fitter.module.layer.weight.detach().clone())


@pytest.mark.parametrize("accumulate_grad_batches", [1, 2, 3])
def test_trainer_accumulate_grad_batches_zero_grad(tmp_path, accumulate_grad_batches):
    """lightning tests/tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py::test_trainer_accumulate_grad_batches_zero_grad:
    20 batches, one epoch: ceil(20 / accumulate_grad_batches) optimizer steps (and zero_grad calls)."""
    steps = Steps()
    fitter = boring_fitter(tmp_path, callbacks=[steps], max_epochs=1, grad_accum_steps=accumulate_grad_batches)
    result = fitter.fit(BoringModel(), RandomDataset(32, 20))
    assert steps.optimizer_steps == result.global_step == math.ceil(20 / accumulate_grad_batches)


@pytest.mark.parametrize(("accumulate_grad_batches", "limit_train_batches"), [(3, 1.0), (3, 0.8), (4, 1.0), (4, 0.7)])
def test_gradient_accumulation_scheduling_last_batch(tmp_path, accumulate_grad_batches, limit_train_batches):
    """lightning tests/tests_pytorch/trainer/test_trainer.py::test_gradient_accumulation_scheduling_last_batch:
    2 epochs of int(64 * limit) batches; the weights change at every window's end and at the
    epoch's last batch (a short window). Checked against a hand-written loop whose short window is
    the mean over the batches it holds (Lightning divides it by accumulate_grad_batches, #19987)."""
    n = int(64 * limit_train_batches)
    steps = Steps()
    fitter = boring_fitter(tmp_path, callbacks=[steps], max_epochs=2, grad_accum_steps=accumulate_grad_batches)
    torch.manual_seed(0)
    module = BoringModel()
    ref = BoringModel()
    ref.load_state_dict(module.state_dict())
    result = fitter.fit(module, RandomDataset(32, n))
    assert result.global_step == 2 * math.ceil(n / accumulate_grad_batches)
    data = RandomDataset(32, n).data
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = []
    for _ in range(2):
        for start in range(0, n, accumulate_grad_batches):
            window = data[start:start + accumulate_grad_batches]
            for row in window:
                (ref.loss(ref(row[None]), None) / len(window)).backward()
            opt.step()
            opt.zero_grad()
            expected.append(ref.layer.weight.detach().clone())
    assert len(steps.weights) == len(expected)
    for got, want in zip(steps.weights, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert all(not torch.equal(a, b) for a, b in zip(steps.weights, steps.weights[1:], strict=False))  # every step moved


@pytest.mark.parametrize(("accumulate_grad_batches", "expected_steps"), [(2, 32), (3, 22)])
def test_num_stepping_batches_accumulate_gradients(tmp_path, accumulate_grad_batches, expected_steps):
    """lightning tests/tests_pytorch/trainer/properties/test_estimated_stepping_batches.py::test_num_stepping_batches_accumulate_gradients:
    one epoch of 64 batches is 32 steps with accumulation 2, 22 with 3 (the schedule's length)."""
    fitter = boring_fitter(tmp_path, max_epochs=1, grad_accum_steps=accumulate_grad_batches)
    fitter.fit(BoringModel(), RandomDataset(32, 64))
    assert fitter.state.max_steps == expected_steps


def test_trainer_max_steps_accumulate_batches(tmp_path):
    """lightning tests/tests_pytorch/trainer/test_trainer.py::test_trainer_max_steps_accumulate_batches:
    32 batches an epoch, accumulation 10, max_steps 42: the run stops at max_steps."""
    fitter = boring_fitter(tmp_path, max_steps=32 + 10, grad_accum_steps=10)
    result = fitter.fit(BoringModel(), RandomDataset(32, 32))
    assert result.global_step == 42

"""Lightning's manual optimization tests (lightning
tests/tests_pytorch/trainer/optimization/test_manual_optimization.py), ported: Lightning's
``automatic_optimization = False`` + ``training_step(batch, batch_idx)`` is lightlike's
``training_step(batch, ctx)``; ``manual_backward`` is ``ctx.backward``, ``opt.step(); opt.zero_grad()``
is ``ctx.step(opt)``."""

from __future__ import annotations

import pytest
import torch
from peers_common import BoringModel, RandomDataset, boring_fitter
from torch import nn

from lightlike.errors import ModuleContractError


class ManualOptModel(BoringModel):
    """``ManualOptModel``: two SGD optimizers at lr 0.1 (here over the layer's weight and its
    bias: lightlike refuses one parameter in two optimizers), three backward passes a step."""

    def __init__(self, shared=False):
        super().__init__()
        self.shared = shared
        self.backward_calls = 0

    def configure_optimizers(self, config):
        if self.shared:
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)]
        return [torch.optim.SGD([self.layer.weight], lr=0.1), torch.optim.SGD([self.layer.bias], lr=0.1)]

    def part(self, batch, train):  # the output, with gradients for the weight or for the bias only
        w, b = self.layer.weight, self.layer.bias
        if not self.shared:
            w, b = (w, b.detach()) if train == "weight" else (w.detach(), b)
        return self.loss(nn.functional.linear(batch, w, b), batch)

    def training_step(self, batch, ctx):
        opt_a, opt_b = ctx.optimizers
        assert self.layer.weight.grad is None  # make sure there are no grads
        loss_1 = self.part(batch, "weight")
        ctx.backward(loss_1)
        self.backward_calls += 1
        ctx.step(opt_a)
        assert self.layer.weight.grad is None
        loss_2 = self.part(batch, "bias")
        ctx.backward(loss_2)  # Lightning: manual_backward(loss_2, retain_graph=True), then again
        loss_2 = self.part(batch, "bias")
        ctx.backward(loss_2)
        self.backward_calls += 2
        assert self.layer.bias.grad is not None
        ctx.step(opt_b)
        assert self.layer.bias.grad is None
        return loss_2.detach()


def _fit(tmp_path, module, limit_train_batches=2, **fields):
    fitter = boring_fitter(tmp_path, max_epochs=1, log_every=1, lr_scheduler="linear", **fields)  # (the default)
    return fitter, fitter.fit(module, RandomDataset(32, limit_train_batches))


def test_multiple_optimizers_manual_call_counts(tmp_path):
    """lightning tests/tests_pytorch/trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_manual_call_counts:
    2 batches, 3 backward passes each."""
    module = ManualOptModel()
    _fit(tmp_path, module)
    assert module.backward_calls == 2 * 3


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="docs/migrating.md: `global_step` counts training steps")
def test_multiple_optimizers_manual_global_step(tmp_path):
    """lightning tests/tests_pytorch/trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_manual_call_counts:
    ``trainer.global_step == limit_train_batches * 2``: Lightning counts every optimizer's step."""
    _, result = _fit(tmp_path, ManualOptModel())
    assert result.global_step == 2 * 2


@pytest.mark.xfail(strict=True, raises=ModuleContractError,
                   reason="docs/migrating.md: No parameter may belong to two optimizers")
def test_multiple_optimizers_over_the_same_parameters(tmp_path):
    """lightning tests/tests_pytorch/trainer/optimization/test_manual_optimization.py::ManualOptModel
    as written: both optimizers over ``self.layer.parameters()``."""
    _fit(tmp_path, ManualOptModel(shared=True))


def test_manual_backward_retain_graph(tmp_path):
    """lightning tests/tests_pytorch/trainer/optimization/test_manual_optimization.py::ManualOptModel:
    ``manual_backward(loss_2, retain_graph=True)`` then ``manual_backward(loss_2)`` over one graph:
    the gradient is twice one backward's (against the same two backward passes by hand)."""
    torch.manual_seed(0)

    class Twice(BoringModel):
        def training_step(self, batch, ctx):
            loss = self.loss(self(batch), batch)
            ctx.backward(loss, retain_graph=True)
            ctx.backward(loss)
            ctx.step(ctx.optimizers[0])
            return loss.detach()

        def configure_optimizers(self, config):
            return [torch.optim.SGD(self.parameters(), lr=0.1)]

    module = Twice()
    ref = nn.Linear(32, 2)
    ref.load_state_dict(module.layer.state_dict())
    _fit(tmp_path, module, limit_train_batches=1)
    x = RandomDataset(32, 1).data[0][None]
    out = ref(x)
    loss = nn.functional.mse_loss(out, torch.ones_like(out))
    loss.backward(retain_graph=True)
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    torch.testing.assert_close(module.layer.weight, ref.weight)
    torch.testing.assert_close(module.layer.bias, ref.bias)


def test_manual_optimization_matches_a_hand_loop(tmp_path):
    """The weights after the 2 steps of ``ManualOptModel``, against the same three backward passes
    and two SGD steps written by hand."""
    torch.manual_seed(0)
    module = ManualOptModel()
    ref = nn.Linear(32, 2)
    ref.load_state_dict(module.layer.state_dict())
    _fit(tmp_path, module)
    opt_a, opt_b = torch.optim.SGD([ref.weight], lr=0.1), torch.optim.SGD([ref.bias], lr=0.1)
    mse = lambda out: nn.functional.mse_loss(out, torch.ones_like(out))  # noqa: E731
    for row in RandomDataset(32, 2).data:
        x = row[None]
        mse(nn.functional.linear(x, ref.weight, ref.bias.detach())).backward()
        opt_a.step()
        opt_a.zero_grad()
        mse(nn.functional.linear(x, ref.weight.detach(), ref.bias)).backward()
        mse(nn.functional.linear(x, ref.weight.detach(), ref.bias)).backward()
        opt_b.step()
        opt_b.zero_grad()
    torch.testing.assert_close(module.layer.weight, ref.weight)
    torch.testing.assert_close(module.layer.bias, ref.bias)


class ManualOptimBoringModel(BoringModel):
    """Lightning's ``ManualOptimBoringModel``: one SGD at lr 0.1 with ``StepLR(step_size=1)``, stepped
    by hand in ``training_step``; Lightning never steps the scheduler itself."""

    def configure_optimizers(self, config):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return [(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))]

    def training_step(self, batch, ctx):
        loss = self.loss(self(batch), batch)
        ctx.backward(loss)
        ctx.step(ctx.optimizers[0])
        return loss.detach()


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="docs/migrating.md: A scheduler steps each time `ctx.step` of its optimizer")
def test_lr_scheduler_step_not_called(tmp_path):
    """lightning tests/tests_pytorch/trainer/optimization/test_manual_optimization.py::test_lr_scheduler_step_not_called:
    2 steps (fast_dev_run=2): the scheduler's step was called once (at its construction)."""
    fitter, _ = _fit(tmp_path, ManualOptimBoringModel())
    (_, scheduler), = fitter.scheduler.pairs
    assert scheduler.last_epoch == 0

"""One training step, two ways to write it: the same module as ``forward`` + ``loss`` (automatic
optimization) and as ``training_step(batch, ctx)`` (manual) behaves the same on a NaN loss under
"skip", a NaN gradient under "raise", a 16-mixed overflow and a scheduler; each mode against a
hand-written loop where one is plain to write."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params

import lightlike as ll
from lightlike.errors import NonFiniteGradientError


class Faulty(Classifier):
    """A classifier whose loss at step ``at`` is made non-finite, or its gradient, or huge
    (``fault``: "nan-loss", "nan-grad" (a finite loss: sqrt at 0), "overflow" (1e35: finite in
    fp32, infinite once a 16-mixed scaler multiplies it)). Its optimizer: SGD with momentum and a
    StepLR that halves the rate every step."""

    def __init__(self, fault: str = "", at: int = 2):
        super().__init__()
        self.fault, self.at, self.step = fault, at, 0
        self.z = torch.nn.Parameter(torch.zeros(1))

    def loss(self, outputs, batch):
        loss = super().loss(outputs, batch)
        if self.step != self.at:
            return loss + 0.0 * self.z.sum()
        if self.fault == "nan-loss":
            return loss + self.z.sum() * float("nan")
        if self.fault == "nan-grad":
            return loss + self.z.sqrt().sum()
        return loss * 1e35 + 0.0 * self.z.sum()

    def configure_optimizers(self, config):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                                                   "interval": "step"}}


class Counting(ll.Callback):
    """Tells the module which step it is in (from 1)."""

    def on_step_start(self, fitter, state, control):
        fitter.module.step = state.global_step + 1


class FaultyManual(Faulty):
    """The same module, stepping itself."""

    def training_step(self, batch, ctx):
        loss = self.loss(self(batch), batch)
        ctx.backward(loss)
        ctx.step(ctx.optimizers[0])
        return loss


def fit(tmp_path, module, name, **kw):
    kw = {"max_steps": 4, "batch_size": 8, "shuffle": False, "seed": 0, "loggers": [], "model_summary": False,
          "accelerator": "cpu", "output_dir": str(tmp_path / name), "log_every": 1, **kw}
    f = ll.Fitter(callbacks=[Counting()], **kw)
    return f, f.fit(module, DictDataset(n=64))


def both(fault):
    torch.manual_seed(0)
    auto = Faulty(fault)
    manual = FaultyManual(fault)
    manual.load_state_dict(auto.state_dict())
    return auto, manual


def hand_loop(module, steps, skip_at=None, scaler=None):
    """SGD + StepLR over the first ``steps`` batches of 8, in order; ``skip_at``: no update, no
    scheduler step, at that step; ``scaler``: torch's AMP recipe under fp16 autocast."""
    cfg = module.configure_optimizers(None)
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    data = DictDataset(n=64)
    for step in range(1, steps + 1):
        module.step = step
        batch = {k: v[(step - 1) * 8:step * 8] for k, v in (("x", data.x), ("y", data.y))}
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = module.loss(module(batch), batch)
        if step == skip_at:
            opt.zero_grad(set_to_none=True)
            continue
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            before = scaler.get_scale()
            scaler.update()
            applied = scaler.get_scale() >= before
        else:
            opt.step()
            applied = True
        opt.zero_grad(set_to_none=True)
        if applied:
            sched.step()
    return opt, sched


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_a_nan_loss_under_skip_is_skipped_and_not_logged(tmp_path, mode, caplog):
    """A NaN loss at step 2 under "skip": no update, no scheduler step, the loss is not in the
    training loss or any row, one warning naming the loss; the weights are the hand loop's that
    skips step 2."""
    auto, manual = both("nan-loss")
    module = auto if mode == "automatic" else manual
    ref = copy.deepcopy(auto)
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        f, result = fit(tmp_path, module, mode, nonfinite_loss="skip")
    _, sched = hand_loop(ref, 4, skip_at=2)
    assert result.skipped_steps == 1 and torch.isfinite(torch.tensor(result.training_loss))
    assert torch.equal(flat_params(module), flat_params(ref))
    assert f.scheduler.get_last_lr() == sched.get_last_lr()
    losses = [row["train/loss"] for row in f.state.log_history if "train/loss" in row]
    assert len(losses) == 4 and losses[1] != losses[1]  # step 2's row has no loss (NaN: nothing to average)
    assert "non-finite loss at step 2: step skipped" in caplog.text


def test_both_modes_log_and_return_the_same_numbers_on_a_nan_loss(tmp_path):
    """The same module written both ways: the same training loss, rows and weights."""
    auto, manual = both("nan-loss")
    fa, ra = fit(tmp_path, auto, "a", nonfinite_loss="skip")
    fm, rm = fit(tmp_path, manual, "m", nonfinite_loss="skip")
    assert ra.training_loss == rm.training_loss and ra.skipped_steps == rm.skipped_steps == 1
    assert torch.equal(flat_params(auto), flat_params(manual))
    rows = [[(k, v) for k, v in r.items() if k != "train/loss"] for r in fa.state.log_history]
    assert rows == [[(k, v) for k, v in r.items() if k != "train/loss"] for r in fm.state.log_history]
    assert "train/grad_norm" in fm.state.log_history[0]  # one optimizer: its norm, in both modes


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_a_nan_gradient_under_raise_names_its_step(tmp_path, mode):
    """A finite loss with a NaN gradient at the last step, under "raise": the gradient is named,
    with its step (the losses are all finite, so only the gradient check can raise)."""
    auto, manual = both("nan-grad")
    with pytest.raises(NonFiniteGradientError, match="step 2"):
        fit(tmp_path, auto if mode == "automatic" else manual, mode, max_steps=2)


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_a_16_mixed_overflow_skips_the_update_and_the_scheduler(tmp_path, mode):
    """An overflow at step 2 under 16-mixed: the scaler skips the update and lowers its scale,
    the scheduler does not step, the step is counted; the rest is torch's AMP recipe."""
    auto, manual = both("overflow")
    module = auto if mode == "automatic" else manual
    ref = copy.deepcopy(auto)
    f, result = fit(tmp_path, module, mode, precision="16-mixed")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    _, sched = hand_loop(ref, 4, scaler=scaler)
    assert result.skipped_steps == 1
    assert f.strategy.precision.scaler.get_scale() == scaler.get_scale() == 2.0**15
    assert f.scheduler.get_last_lr() == sched.get_last_lr() == [0.1 * 0.5**3]
    assert torch.equal(flat_params(module), flat_params(ref))

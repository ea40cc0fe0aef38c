"""Manual optimization used wrongly, on one process: each case is one clear warning or error
naming what to change (issue 42). The DDP cases: tests/strategies/test_manual_ddp_misuse.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.errors import ModuleContractError


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=24):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5]])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Probe(ll.TaskModule):
    """One linear layer, one SGD optimizer with a step decay; ``mode`` says how training_step
    misuses the step context; ``results`` keeps what ctx.step returned."""

    def __init__(self, mode):
        super().__init__()
        self.a, self.mode, self.results, self.ctx = nn.Linear(3, 1), mode, [], None

    def forward(self, batch):
        return self.a(batch["x"])

    def configure_optimizers(self, config):
        opt = torch.optim.SGD(self.a.parameters(), 0.1)
        return [(opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))]

    def training_step(self, batch, ctx):
        (opt,) = ctx.optimizers
        loss = ((self(batch) - batch["y"]) ** 2).mean()
        self.ctx = ctx
        if self.mode != "step only":
            ctx.backward(loss)
        if self.mode == "direct":
            opt.step()
            opt.zero_grad()
        elif self.mode != "backward only":
            self.results.append(ctx.step(opt))
        return loss.detach()


def fit(tmp_path, module, steps=3, **kw):
    f = ll.Fitter(max_steps=steps, batch_size=8, shuffle=False, loggers=[], model_summary=False, accelerator="cpu",
                  progress_bar=False, output_dir=str(tmp_path / "run"), save_every=None, **kw)
    f.fit(module, Rows())
    return f


def caught(tmp_path, module, **kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        f = fit(tmp_path, module, **kw)
    return f, [str(w.message) for w in got if issubclass(w.category, UserWarning)]


def test_backward_without_any_step_warns_once(tmp_path):
    """ctx.backward and no ctx.step in 3 steps: nothing trains; one warning, at step 1, says so
    and what to call."""
    module = Probe("backward only")
    start = copy.deepcopy(module.a.state_dict())
    _, said = caught(tmp_path, module)
    kept = [m for m in said if "called ctx.backward but no ctx.step" in m]
    assert kept == [kept[0]] and kept[0].startswith("training_step 1 called") and "ctx.step(optimizer)" in kept[0]
    assert all(torch.equal(v, start[k]) for k, v in module.a.state_dict().items())


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_step_without_gradients_warns_once_and_returns_false(tmp_path, precision):
    """ctx.step with no gradient at all (no ctx.backward): before, torch.stack raised 'expects a
    non-empty TensorList'. Now ctx.step returns False each time, one warning names the
    optimizer and the step, the weights and the scheduler's rate stay (it steps with updates)."""
    module = Probe("step only")
    start = copy.deepcopy(module.a.state_dict())
    f, said = caught(tmp_path, module, precision=precision)
    empty = [m for m in said if "none of its parameters has a gradient" in m]
    assert empty == [empty[0]] and empty[0].startswith("ctx.step(ctx.optimizers[0]) at step 1:")
    assert module.results == [False, False, False]
    assert all(torch.equal(v, start[k]) for k, v in module.a.state_dict().items())
    assert f.scheduler.get_last_lr() == [0.1]


def test_raw_optimizer_step_warns_once_naming_what_it_skips(tmp_path):
    """opt.step() on the raw optimizer (the Lightning habit) instead of ctx.step: the update
    happens as the user wrote it (the weights of a hand loop), and one warning says that
    clipping, the non-finite check and the scheduler were skipped and to call ctx.step."""
    module = Probe("direct")
    ref = copy.deepcopy(module.a)
    f, said = caught(tmp_path, module, max_grad_norm=1e-3)
    direct = [m for m in said if "was called directly" in m]
    assert direct == [direct[0]], said
    assert direct[0].startswith("ctx.optimizers[0].step() was called directly in training_step 1")
    assert "gradient clipping (max_grad_norm, max_grad_value)" in direct[0] and "Call ctx.step(optimizer)" in direct[0]
    assert not [m for m in said if "no ctx.step" in m]  # it was stepped, if not by ctx.step
    opt, data = torch.optim.SGD(ref.parameters(), 0.1), Rows()
    for i in range(3):  # no clipping, no schedule: what opt.step() did
        batch = data[i * 8:(i + 1) * 8]
        ((ref(batch["x"]) - batch["y"]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in module.a.state_dict().items())
    assert f.scheduler.get_last_lr() == [0.1]


@pytest.mark.parametrize("max_norm", [-1.0, 0.0, float("nan")])
def test_clip_gradients_refuses_a_norm_not_above_zero(tmp_path, max_norm):
    """ctx.clip_gradients(opt, -1.0) multiplied the gradients by a negative factor (training
    went uphill without a word); 0 zeroed them. Now an error names max_norm."""
    class Clipping(Probe):
        def training_step(self, batch, ctx):
            ctx.backward(((self(batch) - batch["y"]) ** 2).mean())
            ctx.clip_gradients(ctx.optimizers[0], max_norm)
            ctx.step(ctx.optimizers[0])

    with pytest.raises(ModuleContractError, match=r"max_norm=.* at step 1: max_norm must be a number > 0"):
        fit(tmp_path, Clipping("clip"))


def test_clip_gradients_with_a_norm_above_zero_clips(tmp_path):
    """The check lets a positive norm through: one step clipped to 1e-3 moves the weights by
    lr x 1e-3 at most (they move)."""
    class Clipping(Probe):
        def training_step(self, batch, ctx):
            ctx.backward(((self(batch) - batch["y"]) ** 2).mean())
            self.results.append(float(ctx.clip_gradients(ctx.optimizers[0], 1e-3)))
            ctx.step(ctx.optimizers[0])
            return torch.zeros(())

    module = Clipping("clip")
    start = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
    fit(tmp_path, module, steps=1)
    moved = torch.cat([p.detach().flatten() for p in module.parameters()]) - start
    assert module.results[0] > 1e-3 and 0 < moved.norm() <= 0.1 * 1e-3 * 1.01


def test_trainable_parameters_in_no_optimizer_are_named_at_set_up(tmp_path):
    """A layer left out of every optimizer never trains: a warning at set-up names its
    parameters."""
    class TwoLayers(Probe):
        def __init__(self):
            super().__init__("plain")
            self.b = nn.Linear(3, 1)
            self.frozen = nn.Linear(3, 1).requires_grad_(False)

        def forward(self, batch):
            return self.a(batch["x"]) + self.b(batch["x"]) + self.frozen(batch["x"])

    _, said = caught(tmp_path, TwoLayers(), steps=1)
    left = [m for m in said if "in no optimizer" in m]
    assert left == ["2 trainable parameter(s) are in no optimizer configure_optimizers returned, so training never "
                    "changes them: 'b.weight', 'b.bias'. Add them to an optimizer, or freeze them "
                    "(requires_grad_(False)) if that is what you mean"]


def test_every_parameter_in_an_optimizer_gives_no_warning(tmp_path):
    _, said = caught(tmp_path, Probe("plain"), steps=2)
    assert said == []


@pytest.mark.parametrize("call", ["backward", "step", "clip_gradients", "no_sync"])
def test_a_step_context_used_after_its_step_is_an_error(tmp_path, call):
    """The step context kept past its training_step (the fit is over): each call raises,
    naming the call and the step; before, ctx.backward silently added gradients."""
    module = Probe("plain")
    fit(tmp_path, module, steps=2)
    ctx, opt = module.ctx, module.ctx.optimizers[0]
    loss = module(Rows()[0:4]).sum()
    calls = {"backward": lambda: ctx.backward(loss), "step": lambda: ctx.step(opt),
             "clip_gradients": lambda: ctx.clip_gradients(opt, 1.0), "no_sync": lambda: ctx.no_sync()}
    with pytest.raises(ModuleContractError, match=rf"ctx\.{call}\(.*\) was called on the step context of step 2 after "
                                                   "that training_step returned"):
        calls[call]()
    assert all(p.grad is None for p in module.parameters())


class StepsItsScheduler(Probe):
    """A Lightning-style manual module that steps its own scheduler after each update (Lightning
    leaves that to the module; ctx.step already does it)."""

    def configure_optimizers(self, config):
        opt = torch.optim.SGD(self.a.parameters(), 0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        return [(opt, self.sched)]

    def training_step(self, batch, ctx):
        loss = super().training_step(batch, ctx)
        self.sched.step()
        return loss


def test_a_scheduler_the_module_steps_itself_is_said_once(tmp_path):
    module = StepsItsScheduler("normal")
    _, got = caught(tmp_path, module, steps=4)
    said = [m for m in got if "stepped outside ctx.step" in m]
    assert len(said) == 1 and "ctx.optimizers[0]" in said[0] and "before step 2" in said[0], got
    assert module.sched.last_epoch == 8  # twice per update: what the warning is about
    _, quiet = caught(tmp_path / "b", Probe("normal"), steps=4)
    assert not [m for m in quiet if "stepped outside ctx.step" in m], quiet

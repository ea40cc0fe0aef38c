"""Optimizers and learning-rate schedules against hand-computed values."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.optim import build_optimizer, build_scheduler, param_groups, unwrap_configure_optimizers

LR = 1e-3


def lrs(name, steps=100, at=(), **kw):
    cfg = ll.FitConfig(max_steps=steps, learning_rate=LR, lr_scheduler=name, **kw)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    sched = build_scheduler(opt, cfg, steps)
    out = {}
    for k in range(steps + 1):
        out[k] = sched.get_last_lr()[0]
        opt.step()
        sched.step()
    return [out[k] for k in at]


def test_linear():
    assert lrs("linear", at=(0, 5, 10, 55, 100), warmup_steps=10) == pytest.approx([0, 5e-4, 1e-3, 5e-4, 0], abs=1e-12)


def test_warmup_ratio_rounds_up():
    # ceil(0.05 * 90) = 5 warmup steps
    assert lrs("linear", steps=90, at=(1, 5), warmup_ratio=0.05) == pytest.approx([LR / 5, LR])


def test_cosine():
    got = lrs("cosine", at=(10, 55, 100), warmup_steps=10)
    assert got == pytest.approx([LR, LR * 0.5, 0.0], abs=1e-12)
    # a quarter of the way: 0.5 * (1 + cos(pi/4))
    assert lrs("cosine", steps=100, at=(25,))[0] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi / 4)))


def test_cosine_with_restarts():
    # two hard restarts over 100 steps: back to the peak at step 50
    got = lrs("cosine_with_restarts", at=(0, 25, 49, 50, 75), num_cycles=2)
    assert got[0] == pytest.approx(LR) and got[3] == pytest.approx(LR)
    assert got[1] == pytest.approx(LR * 0.5) and got[4] == pytest.approx(LR * 0.5)
    assert got[2] < 0.01 * LR


def test_polynomial():
    got = lrs("polynomial", at=(0, 50, 100), lr_end=1e-4, power=2.0)
    assert got == pytest.approx([LR, (LR - 1e-4) * 0.25 + 1e-4, 1e-4])
    with pytest.raises(ll.ConfigError, match=r"lr_end \(0.01\) < learning_rate \(0.001\)"):
        lrs("polynomial", lr_end=1e-2)
    for power in (-1.0, 0.0):  # -1 climbed to 4x the peak rate, then divided by zero at the last step
        with pytest.raises(ll.ConfigError, match=r"lr_scheduler='polynomial' needs power > 0"):
            lrs("polynomial", lr_end=1e-4, power=power)


def test_constant_and_warmup():
    assert lrs("constant", at=(0, 50, 100)) == pytest.approx([LR] * 3)
    assert lrs("constant_with_warmup", at=(0, 2, 4, 90), warmup_steps=4) == pytest.approx([0, LR / 2, LR, LR])
    with pytest.raises(ll.ConfigError, match="constant_with_warmup"):
        lrs("constant", warmup_steps=3)


def test_scheduler_state_round_trip():
    cfg = ll.FitConfig(max_steps=100, learning_rate=LR, lr_scheduler="cosine", warmup_steps=10)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    sched = build_scheduler(opt, cfg, 100)
    for _ in range(37):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    sched2 = build_scheduler(opt2, cfg, 100)
    sched2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_param_groups_no_decay_on_bias_and_norm():
    net = Net()
    groups = param_groups(net, 0.1)
    names = {id(p): n for n, p in net.named_parameters()}
    decay = [names[id(p)] for p in groups[0]["params"]]
    no_decay = [names[id(p)] for p in groups[1]["params"]]
    assert decay == ["emb.weight", "lin.weight"]  # the tied head appears once, as emb.weight
    assert no_decay == ["lin.bias", "norm.weight", "norm.bias"]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert len(param_groups(net, 0.0)) == 1


def test_build_optimizer_kinds():
    net = Net()
    sgd = build_optimizer(net, ll.FitConfig(max_steps=1, optimizer="sgd", momentum=0.9, learning_rate=0.1))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    adamw = build_optimizer(net, ll.FitConfig(max_steps=1, adam_beta1=0.8, adam_epsilon=1e-6))
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.param_groups[0]["betas"] == (0.8, 0.999) and adamw.param_groups[0]["eps"] == 1e-6


def test_configure_optimizers_forms_and_error(tmp_path):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert unwrap_configure_optimizers(opt) == (opt, None)
    assert unwrap_configure_optimizers((opt, sched)) == (opt, sched)
    assert unwrap_configure_optimizers({"optimizer": opt, "lr_scheduler": sched}) == (opt, sched)
    with pytest.raises(ll.ModuleContractError, match="return an Optimizer"):
        unwrap_configure_optimizers("adam")


def test_configure_optimizers_takes_over(tmp_path):
    from helpers import Classifier, DictDataset

    class OwnOptimizer(Classifier):
        def configure_optimizers(self, config):
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            return opt, {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "step"}

    seen = []

    class LR(ll.Callback):
        def on_step_end(self, fitter, state, control):
            seen.append(fitter.optimizer.param_groups[0]["lr"])

    ll.Fitter(max_steps=3, batch_size=4, output_dir=str(tmp_path), loggers=[], callbacks=[LR()]
              ).fit(OwnOptimizer(), DictDataset(n=16))
    assert seen == [0.25, 0.125, 0.0625]

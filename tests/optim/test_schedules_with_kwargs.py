"""The schedules with arguments of their own (lr_scheduler_kwargs): cosine_with_min_lr, wsd,
inverse_sqrt against values computed by hand and against transformers' own get_scheduler for the
same settings; reduce_lr_on_plateau stepped at evaluations of a real fit, and resumed exactly."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.optim import build_scheduler
from tests.helpers import Classifier, DictDataset, StopAt

LR = 1e-3


def lrs(opt, sched, steps):
    """The lr at every step 0..steps of ``sched``, stepping it as a loop does."""
    out = []
    for _ in range(steps + 1):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def trace(name, steps, kwargs, **fields):
    """The lr of every step 0..steps of lightlike's schedule ``name``."""
    cfg = ll.FitConfig(max_steps=steps, learning_rate=LR, lr_scheduler=name, lr_scheduler_kwargs=kwargs, **fields)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    sched = build_scheduler(opt, cfg, steps)
    return lrs(opt, sched, steps)


def hf_trace(name, steps, warmup, kwargs):
    """The same from transformers' get_scheduler (the HF Trainer's)."""
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    sched = transformers.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=steps,
                                       scheduler_specific_kwargs=kwargs)
    return lrs(opt, sched, steps)


def test_cosine_with_min_lr_by_hand():
    # 10 warmup steps, then 0.5 * (1 + cos(pi * p)) scaled into [min_lr, LR] over the other 90
    got = trace("cosine_with_min_lr", 100, {"min_lr": 1e-4}, warmup_steps=10)
    assert got[5] == pytest.approx(LR / 2)
    assert got[10] == pytest.approx(LR)
    assert got[55] == pytest.approx(0.5 * (LR - 1e-4) + 1e-4)  # half way: the middle of the range
    assert got[100] == pytest.approx(1e-4)  # the end: min_lr, not 0
    quarter = 0.5 * (1 + math.cos(math.pi * 0.25)) * (1 - 0.1) + 0.1
    assert trace("cosine_with_min_lr", 100, {"min_lr_rate": 0.1})[25] == pytest.approx(LR * quarter)


def test_wsd_by_hand():
    # 10 warmup, 70 stable, 20 linear decay steps to 10% of the peak (decay_ratio 0.2 of 100 steps)
    got = trace("wsd", 100, {"decay_ratio": 0.2, "decay_type": "linear", "min_lr_ratio": 0.1}, warmup_steps=10)
    assert got[0] == pytest.approx(0.1 * LR)  # HF's warmup starts at min_lr_ratio
    assert got[5] == pytest.approx((0.5 * 0.9 + 0.1) * LR)
    assert got[10] == got[45] == got[79] == pytest.approx(LR)  # stable
    assert got[90] == pytest.approx((0.5 * 0.9 + 0.1) * LR)  # half way through the decay
    assert got[100] == pytest.approx(0.1 * LR)
    # HF's default decay: cosine, and num_decay_steps as a count
    got = trace("warmup_stable_decay", 40, {"num_decay_steps": 20})
    assert got[20] == pytest.approx(LR) and got[30] == pytest.approx(LR / 2) and got[40] == 0.0


def test_inverse_sqrt_by_hand():
    got = trace("inverse_sqrt", 200, {"timescale": 50}, warmup_steps=10)
    assert got[5] == pytest.approx(LR / 2)
    assert got[10] == pytest.approx(LR)
    assert got[110] == pytest.approx(LR / math.sqrt((110 + 50 - 10) / 50))  # 1 / sqrt(3)
    # timescale defaults to the warmup steps: 1 / sqrt(step / warmup)
    assert trace("inverse_sqrt", 100, {}, warmup_steps=25)[100] == pytest.approx(LR / 2)


@pytest.mark.parametrize(("name", "warmup", "kwargs"), [
    ("cosine_with_min_lr", 7, {"min_lr": 2e-4}),
    ("cosine_with_min_lr", 0, {"min_lr_rate": 0.05}),
    ("warmup_stable_decay", 5, {"num_decay_steps": 15}),
    ("warmup_stable_decay", 5, {"num_decay_steps": 9, "warmup_type": "cosine", "decay_type": "1-sqrt",
                                "min_lr_ratio": 0.2}),
    ("warmup_stable_decay", 4, {"num_decay_steps": 10, "num_stable_steps": 20, "warmup_type": "1-sqrt",
                                "decay_type": "linear"}),
    ("inverse_sqrt", 6, {"timescale": 13}),
    ("inverse_sqrt", 6, {}),
])
@pytest.mark.filterwarnings("ignore:Both num_training_steps and num_stable_steps")  # transformers' own, by design
def test_every_step_equals_transformers_get_scheduler(name, warmup, kwargs):
    assert trace(name, 40, kwargs, warmup_steps=warmup) == pytest.approx(hf_trace(name, 40, warmup, kwargs),
                                                                        rel=1e-12, abs=0)


@pytest.mark.parametrize(("fields", "match"), [
    ({"lr_scheduler": "cosine", "lr_scheduler_kwargs": {"num_cycles": 2}},
     r"lr_scheduler='cosine': lr_scheduler_kwargs has 'num_cycles', which it does not take; it takes none .*set "
     r"num_cycles"),
    ({"lr_scheduler": "inverse_sqrt", "lr_scheduler_kwargs": {"time_scale": 5}},
     r"'time_scale', which it does not take; its arguments: timescale"),
    ({"lr_scheduler": "cosine_with_min_lr"}, "give exactly one of min_lr .* and min_lr_rate"),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 1e-4, "min_lr_rate": 0.1}},
     "give exactly one of min_lr"),
    ({"lr_scheduler": "wsd", "lr_scheduler_kwargs": {"num_decay_steps": 5, "decay_type": "exp"}},
     "decay_type='exp' is not one of linear, cosine, 1-sqrt"),
    ({"lr_scheduler": "wsd", "lr_scheduler_kwargs": {"decay_ratio": 1.5}}, r"decay_ratio=1.5 must be a number in"),
    ({"lr_scheduler": "reduce_lr_on_plateau", "lr_scheduler_kwargs": {"patience": 2, "paitence": 3}},
     r"'paitence', which it does not take; its arguments: mode, factor, patience"),
])
def test_bad_schedule_arguments_are_one_error_at_config(fields, match):
    with pytest.raises(ll.ConfigError, match=match):
        ll.FitConfig(max_steps=10, **fields)


@pytest.mark.parametrize(("fields", "match"), [
    ({"lr_scheduler": "wsd", "lr_scheduler_kwargs": {"num_decay_steps": 8}, "warmup_steps": 5},
     "5 warmup and 8 decay steps are more than the run's 10 steps"),
    ({"lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": 0.5}},
     r"min_lr=0.5 is above learning_rate=0.001"),
    ({"lr_scheduler": "reduce_lr_on_plateau", "eval_every": 2, "warmup_steps": 3}, "it has no warmup"),
    ({"lr_scheduler": "reduce_lr_on_plateau"}, "set eval_every=N or eval_on_epoch_end=True"),
    ({"lr_scheduler": "reduce_lr_on_plateau", "eval_every": 2, "lr_scheduler_kwargs": {"mode": "max"}},
     r"mode='max' contradicts the direction of 'val/loss' \(min"),
    ({"lr_scheduler": "reduce_lr_on_plateau", "eval_every": 2, "lr_scheduler_kwargs": {"factor": 2.0}},
     "ReduceLROnPlateau refused .*Factor should be < 1.0"),
])
def test_bad_schedule_settings_for_the_run_are_one_error_at_set_up(fields, match):
    cfg = ll.FitConfig(max_steps=10, **fields)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    with pytest.raises(ll.ConfigError, match=match):
        build_scheduler(opt, cfg, 10)


# -- reduce_lr_on_plateau in a fit -----------------------------------------------------------------
class Scored(Classifier):
    """``val/score`` is the next of ``scores`` at each evaluation (a whole-set metric)."""

    def __init__(self, scores):
        super().__init__()
        self.scores, self.evaluations = list(scores), 0

    def compute_metrics(self, predictions, labels):
        self.evaluations += 1
        return {"score": self.scores[self.evaluations - 1]}


def plateau_fit(tmp_path, scores, steps, callbacks=(), resume=None, **fields):
    torch.manual_seed(0)
    module = Scored(scores)
    fitter = ll.Fitter(output_dir=str(tmp_path), max_steps=steps, batch_size=4, eval_every=1, log_every=1,
                       optimizer="sgd", learning_rate=0.1, lr_scheduler="reduce_lr_on_plateau",
                       lr_scheduler_kwargs={"patience": 1, "factor": 0.5, "threshold": 0.0},
                       metric_for_best="val/score", greater_is_better=False, loggers=[], model_summary=False,
                       callbacks=list(callbacks), **fields)
    try:
        fitter.fit(module, DictDataset(64), DictDataset(8, seed=1), resume=resume)
    except KeyboardInterrupt:
        pass
    lrs = {row["step"]: row["train/lr"] for row in fitter.state.log_history if "train/lr" in row}
    return fitter, module, lrs


def test_plateau_lowers_the_rate_at_the_evaluation_where_the_metric_stalled(tmp_path):
    # patience 1: the score improves (5, 4), stalls at 4 for two evaluations (steps 3, 4): the
    # rate halves after step 4's evaluation; it improves at step 6 and stalls at 7 and 8: halves again
    fitter, _, lrs = plateau_fit(tmp_path, [5, 4, 4, 4, 4, 3, 3, 3], steps=8, save_strategy="no")
    assert lrs == {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1, 5: 0.05, 6: 0.05, 7: 0.05, 8: 0.05}
    assert fitter.optimizer.param_groups[0]["lr"] == 0.025  # after the last evaluation
    # the module's weights are those of SGD at these rates (the per-step scheduler call changes nothing)
    torch.manual_seed(0)
    ref = Scored([])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = DictDataset(64)
    for step in range(8):
        order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
        idx = order[step * 4:(step + 1) * 4]
        batch = {"x": data.x[idx], "y": data.y[idx]}
        for g in opt.param_groups:
            g["lr"] = lrs[step + 1]
        opt.zero_grad()
        ref.loss(ref(batch), batch).backward()
        opt.step()
    for a, b in zip(fitter.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_plateau_counters_are_checkpointed_and_a_resume_reduces_where_the_whole_run_does(tmp_path):
    # a score that never improves: patience 1 halves the rate after the evaluations of steps 3 and 5
    whole, _, whole_lrs = plateau_fit(tmp_path / "whole", [1.0] * 6, steps=6, save_every=2)
    assert whole_lrs == {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.05, 5: 0.05, 6: 0.025}
    # cut at step 3 (its last checkpoint: step 2, one stalled evaluation counted), then resumed
    plateau_fit(tmp_path / "cut", [1.0] * 6, steps=6, save_every=2, callbacks=[StopAt(3)])
    resumed, module, lrs = plateau_fit(tmp_path / "cut", [1.0] * 6, steps=6, save_every=2, resume=True)
    assert resumed.resumed_from.endswith("checkpoint-2")
    assert {k: v for k, v in lrs.items() if k > 2} == {3: 0.1, 4: 0.05, 5: 0.05, 6: 0.025}
    for a, b in zip(whole.module.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)

"""The learning-rate schedules with arguments of their own (``lr_scheduler_kwargs``), in the HF
Trainer's formulas and with its argument names, so that an HF user's ``lr_scheduler_kwargs`` run
unchanged:

- ``cosine_with_min_lr``: cosine from the peak to ``min_lr`` (or ``min_lr_rate`` times the peak)
  after the warmup (``get_cosine_with_min_lr_schedule_with_warmup``).
- ``wsd`` (also ``warmup_stable_decay``): warmup, a constant stable phase, then a decay over the
  last ``num_decay_steps`` steps (or ``decay_ratio`` of the run's steps), down to
  ``min_lr_ratio`` times the peak (``get_wsd_schedule``).
- ``inverse_sqrt``: warmup, then ``1 / sqrt((step + timescale - warmup) / timescale)``
  (``get_inverse_sqrt_schedule``; ``timescale`` defaults to the warmup steps, or 10 000).
- ``reduce_lr_on_plateau``: torch's ``ReduceLROnPlateau``, stepped with one evaluation metric
  (``metric_for_best``, or ``val/loss``) after each evaluation of a fit, not at each optimizer
  step (``EvaluationPlateau``). Its counters are checkpointed, so a resumed run reduces the
  rate at the evaluation where the uninterrupted one does.

The step schedules are ``LambdaLR`` over module-level functions bound with
``functools.partial``, as the others in ``lightlike.optim``; the partial's arguments come from the
config at every build (also on resume), only ``last_epoch`` from the checkpoint.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from lightlike.best import greater_is_better, resolve_key
from lightlike.errors import ConfigError

#: the schedules built here
NAMES = ("cosine_with_min_lr", "wsd", "warmup_stable_decay", "inverse_sqrt", "reduce_lr_on_plateau")
_SHAPES = ("linear", "cosine", "1-sqrt")  # HF's warmup_type / decay_type
#: the arguments of torch's ReduceLROnPlateau that lr_scheduler_kwargs may give
_PLATEAU_ARGS = tuple(p for p in inspect.signature(ReduceLROnPlateau).parameters if p not in ("optimizer", "verbose"))
#: each schedule's lr_scheduler_kwargs (the schedules of lightlike.optim take none: FitConfig fields)
SCHEDULE_KWARGS: dict[str, tuple[str, ...]] = {
    "cosine_with_min_lr": ("min_lr", "min_lr_rate"),
    "wsd": ("num_decay_steps", "decay_ratio", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio"),
    "warmup_stable_decay": ("num_decay_steps", "decay_ratio", "num_stable_steps", "warmup_type", "decay_type",
                            "min_lr_ratio"),
    "inverse_sqrt": ("timescale",),
    "reduce_lr_on_plateau": _PLATEAU_ARGS,
}
#: FitConfig fields an HF user may put in lr_scheduler_kwargs
_FIELDS = {"num_cycles": "num_cycles", "num_warmup_steps": "warmup_steps", "num_training_steps": "max_steps",
           "lr_end": "lr_end", "power": "power"}


def _fail(name: str, message: str) -> ConfigError:
    return ConfigError(f"lr_scheduler={name!r}: {message}", settings=("lr_scheduler", "lr_scheduler_kwargs"))


def check_schedule_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """``lr_scheduler_kwargs`` for the schedule ``name``: keys it takes, the required ones given,
    values in range (those that do not depend on the run's length). One error naming the
    schedule and the arguments it takes."""
    valid = SCHEDULE_KWARGS.get(name, ())
    bad = [k for k in kwargs if k not in valid]
    if bad:
        fields = [f"{k!r}: set {_FIELDS[k]}" for k in bad if k in _FIELDS]
        takes = f"its arguments: {', '.join(valid)}" if valid else "it takes none (its settings are FitConfig fields)"
        raise _fail(name, f"lr_scheduler_kwargs has {', '.join(map(repr, bad))}, which it does not take; {takes}"
                    + (f" ({'; '.join(fields)})" if fields else ""))
    if name == "cosine_with_min_lr":
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise _fail(name, f"give exactly one of min_lr (the final rate) and min_lr_rate (its ratio to "
                              f"learning_rate) in lr_scheduler_kwargs, got {kwargs}")
        _number(name, kwargs, "min_lr", 0.0, math.inf)
        _number(name, kwargs, "min_lr_rate", 0.0, 1.0)
    elif name in ("wsd", "warmup_stable_decay"):
        if ("num_decay_steps" in kwargs) == ("decay_ratio" in kwargs):
            raise _fail(name, f"give exactly one of num_decay_steps and decay_ratio (of the run's steps) in "
                              f"lr_scheduler_kwargs, got {kwargs}")
        _count(name, kwargs, "num_decay_steps")
        _count(name, kwargs, "num_stable_steps", least=0)
        _number(name, kwargs, "decay_ratio", 0.0, 1.0, low_open=True)
        _number(name, kwargs, "min_lr_ratio", 0.0, 1.0)
        for key in ("warmup_type", "decay_type"):
            if key in kwargs and kwargs[key] not in _SHAPES:
                raise _fail(name, f"{key}={kwargs[key]!r} is not one of {', '.join(_SHAPES)}")
    elif name == "inverse_sqrt":
        _count(name, kwargs, "timescale")
    elif name == "reduce_lr_on_plateau" and kwargs.get("mode", "min") not in ("min", "max"):
        raise _fail(name, f"mode={kwargs['mode']!r} is not 'min' or 'max'")


def _number(name: str, kwargs: dict[str, Any], key: str, low: float, high: float, low_open: bool = False) -> None:
    v = kwargs.get(key)
    if v is None:
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (low < v if low_open else low <= v) and v <= high
    if not ok:
        raise _fail(name, f"{key}={v!r} must be a number in {'(' if low_open else '['}{low}, {high}]")


def _count(name: str, kwargs: dict[str, Any], key: str, least: int = 1) -> None:
    v = kwargs.get(key)
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= least):
        raise _fail(name, f"{key}={v!r} must be an int >= {least}")


# -- the formulas (HF transformers' lr lambdas) ----------------------------------------------------
def _cosine_with_min_lr(step: int, warmup: int, total: int, cycles: float, min_rate: float) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_rate) + min_rate)


def _shape(kind: str, progress: float, rising: bool) -> float:
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress)) if rising else 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)  # "1-sqrt"


def _wsd(step: int, warmup: int, stable: int, decay: int, warmup_type: str, decay_type: str, min_ratio: float,
         cycles: float) -> float:
    if step < warmup:
        factor = _shape(warmup_type, float(step) / float(max(1, warmup)), rising=True)
        return max(0.0, factor * (1.0 - min_ratio) + min_ratio)
    if step < warmup + stable:
        return 1.0
    if step < warmup + stable + decay:
        progress = float(step - warmup - stable) / float(max(1, decay))
        if decay_type == "cosine":  # HF's: num_cycles waves (0.5: half a wave, down to the minimum)
            factor = 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress))
        else:
            factor = _shape(decay_type, progress, rising=False)
        return max(0.0, factor * (1.0 - min_ratio) + min_ratio)
    return min_ratio


def _inverse_sqrt(step: int, warmup: int, timescale: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


def build_schedule(optimizer: torch.optim.Optimizer, config: Any, total: int, warmup: int) -> Any:
    """The schedule ``config.lr_scheduler`` (one of ``NAMES``) over ``total`` optimizer steps,
    ``warmup`` of them warming up."""
    name, kw = config.lr_scheduler, dict(config.lr_scheduler_kwargs)
    check_schedule_kwargs(name, kw)
    fn: Callable[[int], float]
    if name == "cosine_with_min_lr":
        peak = float(optimizer.defaults["lr"])
        rate = kw["min_lr"] / peak if "min_lr" in kw and peak else float(kw.get("min_lr_rate", 0.0))
        if not 0.0 <= rate <= 1.0:
            raise _fail(name, f"min_lr={kw.get('min_lr')!r} is above learning_rate={peak!r}: give a final rate below "
                              "the peak")
        fn = functools.partial(_cosine_with_min_lr, warmup=warmup, total=total, cycles=float(config.num_cycles),
                               min_rate=rate)
    elif name in ("wsd", "warmup_stable_decay"):
        decay = kw.get("num_decay_steps") or math.ceil(round(kw["decay_ratio"] * total, 9))
        stable = kw.get("num_stable_steps", total - warmup - decay)
        if stable < 0:
            raise _fail(name, f"{warmup} warmup and {decay} decay steps are more than the run's {total} steps: "
                              "lower warmup_steps/warmup_ratio or the decay")
        fn = functools.partial(_wsd, warmup=warmup, stable=stable, decay=decay,
                               warmup_type=kw.get("warmup_type", "linear"), decay_type=kw.get("decay_type", "cosine"),
                               min_ratio=float(kw.get("min_lr_ratio", 0.0)), cycles=float(config.num_cycles))
    elif name == "inverse_sqrt":
        fn = functools.partial(_inverse_sqrt, warmup=warmup, timescale=int(kw.get("timescale") or warmup or 10_000))
    else:
        return _plateau(optimizer, config, warmup, kw)
    return LambdaLR(optimizer, fn)


def _plateau(optimizer: torch.optim.Optimizer, config: Any, warmup: int, kw: dict[str, Any]) -> EvaluationPlateau:
    name = "reduce_lr_on_plateau"
    if warmup:
        raise _fail(name, f"it has no warmup (got {warmup} warmup steps): set warmup_steps=0 and warmup_ratio=0")
    if not (config.eval_every or config.eval_on_epoch_end):
        raise _fail(name, "it steps after each evaluation, and this fit evaluates at its end only: set eval_every=N "
                          "or eval_on_epoch_end=True")
    metric = config.metric_for_best or "val/loss"
    mode = "max" if greater_is_better(metric, config.greater_is_better) else "min"
    if kw.setdefault("mode", mode) != mode:
        raise _fail(name, f"mode={kw['mode']!r} contradicts the direction of {metric!r} ({mode}: "
                          f"{'higher' if mode == 'max' else 'lower'} is better, from greater_is_better or the name); "
                          "drop mode, or set greater_is_better")
    try:
        return EvaluationPlateau(optimizer, metric, config.metric_for_best is not None, **kw)
    except (ValueError, TypeError) as e:  # torch's own checks of the values (factor >= 1.0, ...)
        raise _fail(name, f"ReduceLROnPlateau refused lr_scheduler_kwargs {kw}: {e}") from None


class EvaluationPlateau:
    """``reduce_lr_on_plateau``: torch's ``ReduceLROnPlateau`` (``plateau``) stepped with
    ``metrics[metric]`` after each evaluation of a fit (``evaluated``). The loop's per-step
    ``step()`` changes nothing: the rate moves at evaluations only, as the HF Trainer's does.

    The checkpoint holds the counters (``best``, ``num_bad_epochs``, ``cooldown_counter``, ...);
    the settings (``factor``, ``patience``, ...) come from this run's config, so a resumed run
    with a changed ``lr_scheduler_kwargs`` uses the new ones (the resume warning names them)."""

    #: what a checkpoint restores: where the plateau stands, not how it is set
    COUNTERS = ("best", "num_bad_epochs", "cooldown_counter", "last_epoch", "_last_lr")

    def __init__(self, optimizer: torch.optim.Optimizer, metric: str, follows_best: bool = False, **kwargs: Any):
        self.optimizer, self.metric = optimizer, metric
        self.follows_best = follows_best  # metric is metric_for_best, whose errors BestMetric raises
        self.key: str | None = None  # the evaluation metric ``metric`` names, found at the first evaluation
        self.plateau = ReduceLROnPlateau(optimizer, **kwargs)

    def step(self) -> None:
        """Once per optimizer step (as the loop steps every scheduler): nothing."""

    def evaluated(self, metrics: dict[str, float]) -> None:
        """One evaluation's metrics: the plateau counts ``metrics[metric]`` (a NaN is never better,
        so it counts as a bad evaluation) and lowers the rate when it is due. ``metric`` names the
        evaluation metric as for the best checkpoint (``lightlike.best.resolve_key``: ``val/loss``,
        ``loss``, ``eval_loss``, ``val_loss``); one it does not name is the best checkpoint's error
        (raised after this step's checkpoint), or this one's when metric_for_best is unset."""
        if self.key is None or self.key not in metrics:
            try:
                self.key = resolve_key(self.metric, metrics)
            except ConfigError as error:
                if self.follows_best:
                    return  # BestMetric raises it once this step's checkpoint is written
                raise ConfigError(f"lr_scheduler='reduce_lr_on_plateau' follows {self.metric!r}: {error}",
                                  settings=("metric_for_best", "lr_scheduler")) from None
        self.plateau.step(float(metrics[self.key]))

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, **self.plateau.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plateau.load_state_dict({**self.plateau.state_dict(), **{k: state[k] for k in self.COUNTERS
                                                                       if k in state}})


def step_on_evaluation(scheduler: Any, metrics: dict[str, float]) -> None:
    """After an evaluation of a fit: a scheduler that follows a metric (``EvaluationPlateau``,
    ``lightlike.lr_schedulers.Schedulers``) takes it; any other is stepped per optimizer step only."""
    if callable(getattr(scheduler, "evaluated", None)):
        scheduler.evaluated(metrics)


def step_on_epoch_end(scheduler: Any, epochs: int) -> None:
    """At the end of the ``epochs``-th epoch (from 1), before its checkpoint: the schedulers of
    ``configure_optimizers`` with ``interval="epoch"`` (``lightlike.lr_schedulers.Schedulers``)."""
    if callable(getattr(scheduler, "epoch_ended", None)):
        scheduler.epoch_ended(epochs)

"""The schedulers that ``configure_optimizers`` of an automatic module returns, stepped as
Lightning steps them (docs/optimizers.md, "Schedulers from configure_optimizers").

Each scheduler has Lightning's ``LRSchedulerConfig`` settings (``SchedulerConfig``):
``interval`` ("epoch", the default, or "step"), ``frequency`` (every n-th epoch, or every n-th
optimizer step of an epoch), ``monitor`` (the evaluation metric a ``ReduceLROnPlateau`` is
stepped with), ``strict`` and ``name``. A bare scheduler (``(opt, s)``, ``([opt], [s])``,
``{"optimizer": opt, "lr_scheduler": s}``) has the defaults, so it steps at each epoch's end, as
in Lightning. ``Schedulers`` holds one optimizer's schedulers and is what the Fitter steps: per
applied optimizer step (``step``), at each epoch's end (``epoch_ended``) and after each
evaluation (``evaluated``); its state (each scheduler's, and its own counters) is checkpointed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR, ReduceLROnPlateau

from lightlike.best import key_candidates
from lightlike.errors import ConfigError, ModuleContractError

log = logging.getLogger("lightlike")

#: the keys of Lightning's scheduler dict (``LRSchedulerConfig``'s fields)
KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau")
#: the keys of Lightning's optimizer dict
OPTIMIZER_KEYS = ("optimizer", "lr_scheduler", "monitor")
_FORMS = ("return an Optimizer, (optimizer, scheduler), ([optimizer], [scheduler, ...]) or {'optimizer': ..., "
          "'lr_scheduler': ..., 'monitor': ...}, where a scheduler may be Lightning's {'scheduler': s, 'interval': "
          "'step' or 'epoch', 'frequency': n, 'monitor': ..., 'strict': ..., 'name': ...}; or None for the built-in "
          "ones")


@dataclass
class SchedulerConfig:
    """One scheduler and when it steps (Lightning's ``LRSchedulerConfig``)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None
    reduce_on_plateau: bool = False
    bare: bool = field(default=False, compare=False)  # returned without a dict: no interval written


def read_configure_optimizers(result: Any) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    """What an automatic module's ``configure_optimizers`` returned (not None), as its optimizer
    and the configs of its schedulers (none: the configured schedule applies). Every form
    Lightning accepts for one optimizer, and lightlike's ``(optimizer, scheduler or None)``;
    anything else is a ``ModuleContractError`` naming what was returned."""
    monitor = None
    if isinstance(result, (tuple, list)) and len(result) == 1:  # [optimizer] / [{...}]
        result = result[0]
    if isinstance(result, torch.optim.Optimizer):
        return result, []
    if isinstance(result, Mapping):
        unknown = sorted(str(k) for k in result if k not in OPTIMIZER_KEYS)
        if not isinstance(result.get("optimizer"), torch.optim.Optimizer) or unknown:
            raise ModuleContractError(f"configure_optimizers returned {_describe(result)}; {_FORMS}")
        optimizer, entries, monitor = result["optimizer"], result.get("lr_scheduler"), result.get("monitor")
    elif isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], (tuple, list)) \
            and len(result[0]) == 1 and isinstance(result[0][0], torch.optim.Optimizer):
        optimizer, entries = result[0][0], result[1]  # ([optimizer], [scheduler, ...] or scheduler)
    elif isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.optim.Optimizer) \
            and not isinstance(result[1], torch.optim.Optimizer):
        optimizer, entries = result  # lightlike's (optimizer, scheduler or None)
    else:
        several = _optimizers_in(result) > 1
        hint = (" Several optimizers need manual optimization: define training_step(batch, ctx) and step them "
                "there (docs/manual_optimization.md);" if several else "")
        raise ModuleContractError(f"configure_optimizers returned {_describe(result)};{hint} {_FORMS}")
    entries = [] if entries is None else list(entries) if isinstance(entries, (tuple, list)) else [entries]
    return optimizer, [_config(e, optimizer, monitor) for e in entries if e is not None]


def _optimizers_in(x: Any) -> int:
    if isinstance(x, torch.optim.Optimizer):
        return 1
    if isinstance(x, Mapping):
        return _optimizers_in(x.get("optimizer"))
    return sum(_optimizers_in(y) for y in x) if isinstance(x, (tuple, list)) else 0


def _config(entry: Any, optimizer: torch.optim.Optimizer, monitor: str | None) -> SchedulerConfig:
    """One scheduler (bare, or Lightning's dict) as a checked ``SchedulerConfig``."""
    if isinstance(entry, Mapping):
        unknown = sorted(str(k) for k in entry if k not in KEYS)
        if "scheduler" not in entry or unknown:
            raise ModuleContractError(f"configure_optimizers returned a scheduler dict with keys "
                                      f"{sorted(map(str, entry))}: Lightning's keys are {', '.join(KEYS)}. The lr "
                                      "scheduler dict must have the key \"scheduler\" with its item being an lr "
                                      "scheduler")
        settings = dict(entry)
        settings.setdefault("reduce_on_plateau", isinstance(entry["scheduler"], ReduceLROnPlateau))
        config = SchedulerConfig(**settings)
    else:
        plateau = isinstance(entry, ReduceLROnPlateau)
        config = SchedulerConfig(entry, monitor=monitor if plateau else None, reduce_on_plateau=plateau, bare=True)
    _check(config, optimizer)
    return config


def _check(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> None:
    kind = type(config.scheduler).__name__
    if config.interval not in ("step", "epoch"):
        raise ModuleContractError(f"configure_optimizers returned {kind} with interval={config.interval!r}: The "
                                  f"\"interval\" key in lr scheduler dict must be \"step\" (every optimizer step) or "
                                  f"\"epoch\" (every epoch's end) but is \"{config.interval}\"")
    if not (isinstance(config.frequency, int) and not isinstance(config.frequency, bool) and config.frequency > 0):
        raise ModuleContractError(f"configure_optimizers returned {kind} with frequency={config.frequency!r}: give a "
                                  "positive int (it steps every frequency-th interval)")
    if config.reduce_on_plateau and not config.monitor:
        raise ModuleContractError(
            f"configure_optimizers returned {kind} without a monitor: it must include a monitor when a "
            "ReduceLROnPlateau scheduler is used (the evaluation metric it follows), e.g. {'optimizer': opt, "
            "'lr_scheduler': {'scheduler': s, 'monitor': 'val/loss'}}")
    missing = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(config.scheduler, m, None))]
    if missing:
        raise ModuleContractError(f"configure_optimizers returned a scheduler of type {kind} without "
                                  f"{', '.join(m + '()' for m in missing)}; {_FORMS}")
    if getattr(config.scheduler, "optimizer", optimizer) is not optimizer:
        raise ModuleContractError(f"configure_optimizers returned {kind} attached with an optimizer that wasn't "
                                  "returned: build it on the optimizer returned with it")


def check_at_set_up(configs: list[SchedulerConfig], config: Any) -> None:
    """At set-up: a monitored scheduler needs evaluations to step with (``eval_every`` or
    ``eval_on_epoch_end``); a bare scheduler's meaning (each epoch's end) is said once, and a
    OneCycleLR stepped per epoch is questioned (as Lightning does)."""
    for c in configs:
        kind = type(c.scheduler).__name__
        if isinstance(c.scheduler, OneCycleLR) and c.interval == "epoch":
            log.warning("configure_optimizers returned a OneCycleLR with 'interval': 'epoch'. Are you sure you "
                        "didn't mean 'interval': 'step'? (its total_steps count the times it is stepped)")
        if c.bare:
            log.warning("configure_optimizers returned %s without an interval: it steps at each epoch's end, as "
                        "Lightning steps it (not every optimizer step). Return {'scheduler': s, 'interval': 'step'} "
                        "to step it every optimizer step, or 'interval': 'epoch' to say so", kind)
        if not c.reduce_on_plateau or config.eval_every or config.eval_on_epoch_end:
            continue
        message = (f"{kind} follows monitor={c.monitor!r}, an evaluation metric, and this fit evaluates at its end "
                   f"only: set eval_on_epoch_end=True (Lightning validates every epoch) or eval_every=N")
        if c.strict:
            raise ConfigError(message, settings=("eval_on_epoch_end", "eval_every"))
        log.warning("%s (strict=False: it is not stepped)", message)


class Schedulers:
    """One optimizer's schedulers from ``configure_optimizers``, each stepped at its interval:

    - ``interval="step"``: after every ``frequency``-th applied optimizer step of an epoch;
      monitored, after every ``frequency``-th evaluation, with its value.
    - ``interval="epoch"``: at the end of every ``frequency``-th epoch, after the epoch's
      evaluation and before its checkpoint; monitored, with the value of the latest evaluation.

    A monitor names an evaluation metric as ``metric_for_best`` does (``val/loss``, ``loss``,
    ``val_loss``: ``lightlike.best.key_candidates``). One it cannot find is a ``ConfigError``
    listing the metrics there are (``strict``), or a warning and no step."""

    def __init__(self, optimizer: torch.optim.Optimizer, configs: list[SchedulerConfig]):
        self.optimizer, self.configs = optimizer, configs
        self.steps_in_epoch = 0  # applied optimizer steps since the epoch began
        self.evaluations = 0  # evaluations seen (monitored step-interval schedulers count them)
        self.values: list[float | None] = [None] * len(configs)  # each monitor's latest value
        self.names: list[str] = []  # the metrics of the latest evaluation

    def step(self) -> None:
        """After an applied optimizer step."""
        self.steps_in_epoch += 1
        for c in self.configs:
            if c.interval == "step" and not c.reduce_on_plateau and self.steps_in_epoch % c.frequency == 0:
                c.scheduler.step()

    def evaluated(self, metrics: dict[str, float]) -> None:
        """After an evaluation of the fit: each monitor's value is kept; a monitored
        step-interval scheduler steps with it."""
        self.evaluations += 1
        self.names = sorted(metrics)
        for i, c in enumerate(self.configs):
            if not c.reduce_on_plateau:
                continue
            found = key_candidates(c.monitor, metrics)  # type: ignore[arg-type]
            self.values[i] = float(metrics[found[0]]) if len(found) == 1 else None
            if c.interval == "step" and self.evaluations % c.frequency == 0:
                self._step_monitored(c, self.values[i])

    def epoch_ended(self, epochs: int) -> None:
        """At the end of the ``epochs``-th epoch (counted from 1)."""
        self.steps_in_epoch = 0
        for i, c in enumerate(self.configs):
            if c.interval != "epoch" or epochs % c.frequency:
                continue
            if c.reduce_on_plateau:
                self._step_monitored(c, self.values[i])
            else:
                c.scheduler.step()

    def _step_monitored(self, c: SchedulerConfig, value: float | None) -> None:
        if value is not None:
            c.scheduler.step(value)
            return
        found = key_candidates(c.monitor, self.names)  # type: ignore[arg-type]
        what = f", as it names several {found}" if found else ""
        message = (f"{type(c.scheduler).__name__} conditioned on metric {c.monitor!r} which is not available{what}. "
                   + (f"Available metrics are: {self.names} (the last evaluation's)" if self.names
                      else "No evaluation has run yet"))
        if c.strict:
            raise ConfigError(f"{message}: return a monitor the evaluation gives ('<set>/<name>'), or 'strict': False "
                              "to skip the step", settings=("configure_optimizers",))
        log.warning("%s, but strict is set to `False`. Skipping learning rate update.", message)

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [c.scheduler.state_dict() for c in self.configs], "steps_in_epoch": self.steps_in_epoch,
                "evaluations": self.evaluations, "values": list(self.values)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("schedulers") if isinstance(state, Mapping) else None
        if saved is None and isinstance(state, Mapping) and len(self.configs) == 1:  # one scheduler's own state
            state = {"schedulers": [state], "steps_in_epoch": 0, "evaluations": 0, "values": [None]}
            saved = state["schedulers"]
        if not isinstance(saved, list) or len(saved) != len(self.configs):
            raise ConfigError(f"the checkpoint's scheduler state is not that of this module's {len(self.configs)} "
                              "scheduler(s) from configure_optimizers: resume with the module that wrote it")
        for c, s in zip(self.configs, saved, strict=True):
            c.scheduler.load_state_dict(s)
        self.steps_in_epoch, self.evaluations = int(state["steps_in_epoch"]), int(state["evaluations"])
        self.values = [None if v is None else float(v) for v in state["values"]]


def check_epoch_budget(config: Any, max_steps: int) -> None:
    """``max_epochs`` alone whose optimizer steps are too many to count exactly (over 2**53:
    ``max_epochs=1e18``): the run would never end by it, and a schedule over it never moves."""
    if config.max_steps is None and max_steps > 2**53:
        raise ConfigError(
            f"max_epochs={config.max_epochs!r} is {max_steps:.3g} optimizer steps, more than a run takes (the "
            f"learning-rate schedule spreads over them, so it never moves: warmup_ratio would keep the rate at 0): "
            f"to train until a callback or a signal stops it, set max_steps to the steps the schedule should span "
            f"(and lr_scheduler='constant' for none)", settings=("max_epochs", "max_steps"))


def _describe(result: Any) -> str:
    if isinstance(result, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in result[:4]) + (", ..." if len(result) > 4 else "")
        return f"a {type(result).__name__} of {len(result)} ({inner})"
    if isinstance(result, Mapping):
        keys = sorted(str(k) for k in result)
        return f"a dict with keys {keys} (Lightning's: 'optimizer', an Optimizer, and 'lr_scheduler', 'monitor')"
    return f"a {type(result).__name__}"

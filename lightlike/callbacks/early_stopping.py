"""Stop training when a monitored evaluation metric stops improving."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightlike.callbacks.base import Callback
from lightlike.errors import ConfigError
from lightlike.evaluation import is_improvement

if TYPE_CHECKING:
    from lightlike.fitter import Fitter
    from lightlike.state import Control, FitState

log = logging.getLogger("lightlike")


class EarlyStopping(Callback):
    """After each evaluation, count evaluations without an improvement of more than
    ``min_delta`` in ``monitor``; once the count reaches ``patience``, stop training.

    ``mode`` is ``'min'`` or ``'max'``. As Lightning's: ``check_finite`` (default True) stops at
    once when the metric is NaN or infinite (with False a NaN never counts as an improvement);
    ``stopping_threshold`` stops at once when the metric is better than it (``mode='min'``:
    below it), ``divergence_threshold`` when it is worse (above it). A ``monitor`` key missing
    from the evaluation results is an error naming the keys there are.
    The counters go into checkpoints, so a resumed run stops exactly where it would have, and
    one resumed from the checkpoint of the step it stopped at stays stopped (a stop set by a
    callback of your own does not carry over: a time-budget stop resumes and trains on; keep a
    stop that should last in the callback's state and set the flag again in ``on_fit_start``).
    They are restored only into an EarlyStopping built with the same arguments (``init_args``).
    """

    def __init__(self, monitor: str = "val/loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min",
                 check_finite: bool = True, stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None):
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ConfigError(f"EarlyStopping patience must be >= 1, got {patience}")
        for name, value in (("stopping_threshold", stopping_threshold), ("divergence_threshold", divergence_threshold)):
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"EarlyStopping {name} must be a finite number or None, got {value!r}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.mode = mode
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.best: float | None = None
        self.wait = 0
        self.stopped_step: int | None = None
        self._loaded = False  # load_state_dict ran for the coming fit

    def init_args(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "patience": self.patience, "min_delta": self.min_delta, "mode": self.mode,
                "check_finite": self.check_finite, "stopping_threshold": self.stopping_threshold,
                "divergence_threshold": self.divergence_threshold}

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[{self.monitor}]"

    def on_fit_start(self, fitter: Fitter, state: FitState, control: Control) -> None:
        loaded, self._loaded = self._loaded, False
        if fitter.resumed_from is None or not loaded:  # a new run, or a checkpoint without this callback's
            self.best, self.wait, self.stopped_step = None, 0, None  # state: count afresh (an instance used before too)
        elif self.stopped_step is not None:  # resumed from the checkpoint of the step it stopped at
            control.should_training_stop = True
            if state.stop_deferred:  # asked for, held by min_epochs / min_steps: still held
                return
            log.warning("resumed from %s, taken when EarlyStopping stopped the run at step %d: the run stays "
                        "stopped (resume without this EarlyStopping to train on)", fitter.resumed_from,
                        self.stopped_step)

    def on_evaluate(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise ConfigError(
                f"EarlyStopping monitors {self.monitor!r} but evaluation returned {sorted(metrics)}; "
                "pick one of those"
            )
        value = metrics[self.monitor]
        why = self._stops_at_once(value)
        if why is None and is_improvement(value, self.best, self.mode == "max", self.min_delta):
            self.best = value
            self.wait = 0
            return
        if why is None:
            self.wait += 1
            if self.wait < self.patience:
                return
            why = ("is NaN" if math.isnan(value) else f"has not improved on {self.best:.6g} by more than "
                   f"{self.min_delta}") + f" for {self.wait} evaluations"
        control.should_training_stop = True
        self.stopped_step = state.global_step
        log.info("early stopping at step %d: %s %s", state.global_step, self.monitor, why)

    def _stops_at_once(self, value: float) -> str | None:
        """Why ``value`` stops the run whatever the patience (``check_finite``, the thresholds), or None."""
        better = (lambda a, b: a > b) if self.mode == "max" else (lambda a, b: a < b)
        if self.check_finite and not math.isfinite(value):
            return f"is {value} (check_finite=True)"
        if self.stopping_threshold is not None and better(value, self.stopping_threshold):
            return f"= {value:.6g} reached stopping_threshold={self.stopping_threshold}"
        if self.divergence_threshold is not None and better(-value, -self.divergence_threshold):
            return f"= {value:.6g} passed divergence_threshold={self.divergence_threshold}"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.wait = int(state.get("wait", 0))
        self.stopped_step = state.get("stopped_step")
        self._loaded = True  # for this fit's on_fit_start

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

    ``mode`` is ``'min'`` or ``'max'``. A NaN metric never counts as an improvement. A
    ``monitor`` key missing from the evaluation results is an error naming the keys there are.
    The counters go into checkpoints, so a resumed run stops exactly where it would have, and
    one resumed from the checkpoint of the step it stopped at stays stopped (a stop set by a
    callback of your own does not carry over: a time-budget stop resumes and trains on; keep a
    stop that should last in the callback's state and set the flag again in ``on_fit_start``).
    """

    def __init__(self, monitor: str = "val/loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ConfigError(f"EarlyStopping patience must be >= 1, got {patience}")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.mode = mode
        self.best: float | None = None
        self.wait = 0
        self.stopped_step: int | None = None
        self._loaded = False  # load_state_dict ran for the coming fit

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[{self.monitor}]"

    def on_fit_start(self, fitter: Fitter, state: FitState, control: Control) -> None:
        loaded, self._loaded = self._loaded, False
        if fitter.resumed_from is None or not loaded:  # a new run, or a checkpoint without this callback's
            self.best, self.wait, self.stopped_step = None, 0, None  # state: count afresh (an instance used before too)
        elif self.stopped_step is not None:  # resumed from the checkpoint of the step it stopped at
            control.should_training_stop = True
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
        if is_improvement(value, self.best, self.mode == "max", self.min_delta):
            self.best = value
            self.wait = 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            control.should_training_stop = True
            self.stopped_step = state.global_step
            why = "is NaN" if math.isnan(value) else f"has not improved on {self.best:.6g} by more than {self.min_delta}"
            log.info("early stopping at step %d: %s %s for %d evaluations", state.global_step,
                     self.monitor, why, self.wait)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.wait = int(state.get("wait", 0))
        self.stopped_step = state.get("stopped_step")
        self._loaded = True  # for this fit's on_fit_start

"""The callbacks the Fitter adds itself: the progress bar, and the check that
``gradient_checkpointing`` is not a silent no-op (the check that the loss reaches the parameters
is the step's: ``lightlike/step.py``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightlike.callbacks.base import Callback
from lightlike.callbacks.progress import ProgressBar
from lightlike.module import CheckpointTally, TaskModule

if TYPE_CHECKING:
    from lightlike.fitter import Fitter
    from lightlike.state import Control, FitState

log = logging.getLogger("lightlike")


class GradientCheckpointingCheck(Callback):
    """``gradient_checkpointing=True`` acts only where the module's ``forward`` calls
    ``self.maybe_checkpoint(...)`` (or where the module handles the switch itself, as the
    transformers adapter does): after the first training step, warn once if it did not."""

    def __init__(self) -> None:
        self.checked = False
        self.tally = CheckpointTally()

    def on_fit_start(self, fitter: Fitter, state: FitState, control: Control) -> None:
        if not self.checked:
            self.tally.start()

    def on_step_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        if self.checked:
            return
        self.checked = True
        self.tally.stop()
        module: Any = fitter.module
        # a strategy that checkpoints the module's blocks itself (FSDP's shard units) says so
        if not self.tally.calls and not getattr(fitter.strategy, "checkpoints_activations", False):
            log.warning("gradient_checkpointing=True, but %s.forward never called self.maybe_checkpoint(fn, *args): "
                        "no activation is checkpointed. Wrap the blocks to recompute in maybe_checkpoint, or "
                        "drop gradient_checkpointing", type(module).__name__)

    def on_fit_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        self.tally.stop()

    def on_exception(self, fitter: Fitter, state: FitState, control: Control, error: BaseException) -> None:
        self.tally.stop()


def built_in_callbacks(config: Any, module: Any, is_global_zero: bool) -> list[Callback]:
    """The progress bar (main process; when it shows), and the gradient checkpointing check when
    that switch is on and the module does not handle it itself (it overrides
    ``gradient_checkpointing_enable``)."""
    bar = ProgressBar(enabled=config.progress_bar if is_global_zero else False)
    callbacks: list[Callback] = [bar] if bar.active() else []
    own_switch = getattr(type(module), "gradient_checkpointing_enable", None) is not TaskModule.gradient_checkpointing_enable
    if config.gradient_checkpointing and not own_switch:
        callbacks.append(GradientCheckpointingCheck())
    return callbacks

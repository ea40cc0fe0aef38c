"""The callbacks the Fitter adds itself: the progress bar, and a check that a switch is not a
silent no-op."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightlike.callbacks.base import Callback

if TYPE_CHECKING:
    from lightlike.fitter import Fitter
    from lightlike.state import Control, FitState

log = logging.getLogger("lightlike")


class GradientCheckpointingCheck(Callback):
    """``gradient_checkpointing=True`` acts only where the module's ``forward`` calls
    ``self.maybe_checkpoint(...)`` (or where the module handles the flag itself, as the
    transformers adapter does): after the first training step, warn once if it did not."""

    def __init__(self) -> None:
        self.checked = False

    def on_step_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        if self.checked:
            return
        self.checked = True
        module: Any = fitter.module
        if not module.__dict__.get("_checkpointed", False):
            log.warning("gradient_checkpointing=True, but %s.forward never called self.maybe_checkpoint(fn, *args): "
                        "no activation is checkpointed. Wrap the blocks to recompute in maybe_checkpoint, or "
                        "drop gradient_checkpointing", type(module).__name__)


def built_in_callbacks(config: Any, module: Any, is_global_zero: bool) -> list[Callback]:
    """The progress bar (main process; when it shows), and the gradient checkpointing check when
    that switch is on and the module does not handle the flag itself (a property)."""
    from lightlike.callbacks.progress import ProgressBar

    bar = ProgressBar(enabled=config.progress_bar if is_global_zero else False)
    callbacks: list[Callback] = [bar] if bar.active() else []
    if config.gradient_checkpointing and not isinstance(getattr(type(module), "gradient_checkpointing", None), property):
        callbacks.append(GradientCheckpointingCheck())
    return callbacks

"""The callbacks the Fitter adds itself: the progress bar, and checks that a switch or a loss is
not a silent no-op."""

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


class NoGradientCheck(Callback):
    """A loss that reaches none of the optimizer's parameters (layers kept in a plain list, so
    not registered; outputs detached) trains nothing, for a whole run, without an error: at the
    first step that reaches the optimizer, warn once (main process) if no trainable parameter
    of the optimizer got a gradient. ``p.grad is None`` is read on the host: no device sync.
    A strategy that keeps gradients off the parameters (DeepSpeed's ZeRO buffers) says so
    (``gradients_on_parameters``), and is not checked."""

    def __init__(self) -> None:
        self.checked = False

    def on_before_optimizer_step(self, fitter: Fitter, state: FitState, control: Control, optimizer: Any) -> None:
        if self.checked:
            return
        self.checked = True
        strategy: Any = fitter.strategy
        if not getattr(strategy, "gradients_on_parameters", True) or not strategy.is_global_zero:
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if params and all(p.grad is None for p in params):
            log.warning("no gradient reached any of the optimizer's %d trainable parameters at step %d: the loss is "
                        "not connected to them, so training changes nothing. Compute loss() from forward()'s "
                        "outputs without .detach(), with layers the module registers (in a plain list or dict they "
                        "are not: use nn.ModuleList or nn.ModuleDict)", len(params), state.global_step + 1)


def built_in_callbacks(config: Any, module: Any, is_global_zero: bool) -> list[Callback]:
    """The progress bar (main process; when it shows), the check that the loss reaches the
    parameters, and the gradient checkpointing check when that switch is on and the module does
    not handle it itself (it overrides ``gradient_checkpointing_enable``)."""
    bar = ProgressBar(enabled=config.progress_bar if is_global_zero else False)
    callbacks: list[Callback] = [bar] if bar.active() else []
    callbacks.append(NoGradientCheck())
    own_switch = getattr(type(module), "gradient_checkpointing_enable", None) is not TaskModule.gradient_checkpointing_enable
    if config.gradient_checkpointing and not own_switch:
        callbacks.append(GradientCheckpointingCheck())
    return callbacks

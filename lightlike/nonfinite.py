"""The non-finite check of each training step (``nonfinite_loss``), on the loss AND the gradient.

A finite loss can have a NaN/inf gradient (``sqrt`` or a fractional power at 0, ``log`` at 0,
the norm of a zero vector): checking the loss alone let NaN weights into checkpoints that passed
their own verification. So every step's global gradient norm is computed (``clip_gradients``,
which clipping and logging use anyway; a device tensor) and checked with the losses:

- ``"raise"``: no host read per step. The norm is kept with the pending losses
  (``LossBuffer.add_norm``) and checked where they are read already: at log steps, before every
  save and at the end of the fit. The error names the first step whose loss
  (``NonFiniteLossError``) or gradient (``NonFiniteGradientError``) was not finite, so no
  checkpoint is written after the last finite step; the weights in memory may hold the update
  of the steps in between.
- ``"skip"``: one host read per step, by choice: one flag for "some rank's loss, or the global
  gradient norm, is not finite", agreed by every rank in one all-reduce. A flagged step is
  undone before the optimizer step (no update, the module's buffers put back, its losses not
  logged), counted in ``FitState.skipped_steps``, and a warning names the step and which of loss
  and gradient it was.

Two kinds of strategy do part of this themselves. With a loss scaler (``Strategy.scales_loss``:
``16-mixed``, DeepSpeed's ``16-true``) a non-finite gradient is an overflow: the scaler skips the
step and lowers its scale, the loop counts the skip once, as an overflow, and checks the loss
only. DeepSpeed's engine computes the norm inside its own step and skips a step whose norm is
not finite (``Strategy.checks_gradients_in_step``): the loop reads that skip as the gradient
check ("raise" then raises at the next read: the norm it reports is infinite).

A fit whose every step was skipped, for whatever cause, raises ``AllStepsSkippedError`` at its
end (after its last checkpoint, which holds the weights it started from): it trained nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from lightlike.errors import AllStepsSkippedError, on_every_rank
from lightlike.state import FitState
from lightlike.utils.buffers import restore_buffers, snapshot_buffers

log = logging.getLogger("lightlike")


class NonFiniteCheck:
    """One fit's non-finite check (see the module's docstring). The loop calls ``begin_step``
    before a step's forward passes, ``skipped`` once its gradients are clipped (before the
    optimizer step), ``applied`` after the optimizer step, and ``check_trained`` at the end."""

    def __init__(self, policy: str, strategy: Any, state: FitState):
        self.skip = policy == "skip"
        self.strategy, self.state = strategy, state
        self.scales_loss = strategy.scales_loss
        # the loop checks the norm itself where it is known before the step and no scaler owns it
        self.checks_norm = not self.scales_loss and not strategy.checks_gradients_in_step
        self.steps = 0  # steps this fit took
        self.causes: Counter[str] = Counter()  # this fit's skipped steps by cause
        self.buffers: Any = None

    def begin_step(self, module: torch.nn.Module) -> None:
        """Count the step; under "skip" keep a copy of the buffers (BatchNorm's statistics) that
        its forward passes may write NaN into."""
        self.steps += 1
        self.buffers = snapshot_buffers(module) if self.skip else None

    def skipped(self, run: Any, norm: torch.Tensor | None, micro_batches: int, step: int) -> bool:
        """Under "skip": whether any rank's losses of this step, or the global gradient norm,
        are not finite (one all-reduce, one host read); if so the step is undone here."""
        if not self.skip:
            return False
        losses = run.losses.last_losses(micro_batches)
        flags = [~torch.isfinite(losses).all()]
        if self.checks_norm and norm is not None:
            flags.append(~torch.isfinite(norm).to(losses.device))
        agreed = self.strategy.collectives.all_reduce(torch.stack(flags).to(torch.int32), op="max").tolist()
        if not any(agreed):
            return False
        self._undo(run, micro_batches, step, "loss" if agreed[0] else "gradient")
        self.strategy.precision.abandon_step(run.optimizer)  # a scaler that unscaled this step forgets it
        return True

    def applied(self, run: Any, stepped: bool, norm: torch.Tensor | None, micro_batches: int, step: int) -> bool:
        """After the optimizer step: whether its update was applied. Under "raise" the norm is
        kept for the next read of the losses. A step the strategy skipped is a loss-scale
        overflow, or (``checks_gradients_in_step``) a non-finite gradient, undone under "skip"."""
        if not self.skip and not self.scales_loss and norm is not None:
            run.losses.add_norm(norm, step)  # checked with the losses: raises there if not finite
        if stepped:
            return True
        if self.skip and not self.scales_loss:
            self._undo(run, micro_batches, step, "gradient")
        else:
            self.causes["overflow" if self.scales_loss else "gradient"] += 1
            self.state.skipped_steps += 1
        return False

    def _undo(self, run: Any, micro_batches: int, step: int, cause: str) -> None:
        """A step skipped for a non-finite ``cause``: no update, buffers back, losses dropped, counted."""
        run.optimizer.zero_grad(set_to_none=True)
        restore_buffers(self.buffers)
        run.grad_norm = None
        run.losses.drop_last(micro_batches)
        self.causes[cause] += 1
        self.state.skipped_steps += 1
        what = "loss" if cause == "loss" else "gradient (the loss was finite)"
        log.warning("non-finite %s at step %d: step skipped (%d skipped so far)", what, step,
                    self.state.skipped_steps)

    def check_trained(self) -> None:
        """At the end of the fit: raise if every step it took was skipped (every rank agrees:
        each skip was decided for all ranks)."""
        if self.steps and sum(self.causes.values()) >= self.steps:
            raise on_every_rank(AllStepsSkippedError(self.steps, dict(self.causes)))

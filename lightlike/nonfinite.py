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

Where the update itself guards against a non-finite gradient, the loop leaves it there: a loss
scaler (``16-mixed``, DeepSpeed's ``16-true``) skips the update and lowers its scale (counted
once, as an overflow, and the loss is checked only); DeepSpeed's engine computes the norm inside
its own step and skips a step whose norm is not finite (read as the gradient check's skip;
"raise" then raises at the next read: the norm it reports is infinite). ``Strategy.step`` says
which, by the norm it hands the check before the update (None: the update guards itself) and
by what it reports after (``StepResult``).

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
    """One fit's non-finite check (see the module's docstring), used by the ``StepContext``:
    ``begin_step`` before a step's forward passes, ``vet`` before each update, ``count`` and
    ``undo`` for a step that was skipped, ``check_trained`` at the end of the fit."""

    def __init__(self, policy: str, collectives: Any, device: torch.device, state: FitState):
        self.skip, self.raises = policy == "skip", policy == "raise"
        self.collectives, self.device = collectives, device  # (where the ranks agree on the flags)
        self.state = state  # (read for the warning only)
        self.causes: Counter[str] = Counter()  # this fit's skipped steps by cause
        self.buffers: Any = None

    def begin_step(self, module: torch.nn.Module) -> None:
        """Under "skip": keep a copy of the buffers (BatchNorm's statistics) that the step's
        forward passes may write NaN into."""
        self.buffers = snapshot_buffers(module)

    def vet(self, losses: list[torch.Tensor], norm: torch.Tensor | None) -> str | None:
        """Under "skip": the cause ("loss" or "gradient") if any rank's ``losses``, or the global
        gradient ``norm``, are not finite (one all-reduce, one host read); else None."""
        device = self.device
        flags = [~torch.isfinite(torch.stack(losses)).all().to(device) if losses
                 else torch.zeros((), dtype=torch.bool, device=device)]
        if norm is not None:
            flags.append(~torch.isfinite(norm).to(device))
        agreed = self.collectives.all_reduce(torch.stack(flags).to(torch.int32), op="max").tolist()
        if not any(agreed):
            return None
        return "loss" if agreed[0] else "gradient"

    def count(self, cause: str) -> None:
        """A step skipped for ``cause`` ("loss", "gradient", "overflow")."""
        self.causes[cause] += 1

    def undo(self, step: int, cause: str) -> None:
        """A step skipped for a non-finite ``cause`` under "skip": its buffers put back, a warning."""
        restore_buffers(self.buffers)
        what = "loss" if cause == "loss" else "gradient (the loss was finite)"
        log.warning("non-finite %s at step %d: step skipped (%d skipped so far)", what, step,
                    self.state.skipped_steps + 1)

    def check_trained(self, steps: int) -> None:
        """At the end of the fit: raise if every one of the ``steps`` it took was skipped (every
        rank agrees: each skip was decided for all ranks)."""
        if steps and sum(self.causes.values()) >= steps:
            raise on_every_rank(AllStepsSkippedError(steps, dict(self.causes)))

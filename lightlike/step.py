"""One training step, written once: the ``StepContext`` that both ways of writing a step use.

A module with ``forward`` + ``loss`` (automatic optimization) is trained by ``AutomaticStep``:
for each micro-batch of the accumulation window, ``with ctx.no_sync(...): ctx.backward(weighted
loss)``, then ``ctx.step(optimizer)``. A module with ``training_step(batch, ctx)`` (manual
optimization, ``lightlike/manual.py``) calls the same context itself. So the non-finite check,
the ``on_before_optimizer_step`` event, the scheduler, the loss scaler's update and the loss
bookkeeping exist once, here:

- ``ctx.backward(loss)``: the strategy's backward (the precision scales the loss under
  ``16-mixed``); under ``nonfinite_loss="skip"`` the loss is kept for the check at the next step.
- ``ctx.step(optimizer)``: the strategy's whole optimizer step (``Strategy.step``: unscale, clip,
  vet, update), vetted by the non-finite check and followed by the callbacks' event before the
  update; then the optimizer's gradients are zeroed and its scheduler steps when the update was
  applied. Returns whether it was.
- ``ctx.losses`` (the ``LossBuffer``): the step functions add the step's losses for the training
  rows; they are taken back out if the step is skipped for a non-finite loss or gradient
  (``"skip"``), so a skipped step is never averaged in.
- ``finish()`` (the Fitter's, at the end of the step): one loss-scale update (torch's recipe for
  several optimizers), a skipped step counted and undone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightlike.errors import ModuleContractError
from lightlike.nonfinite import NonFiniteCheck
from lightlike.optimizers.lomo import FusedBackward, check_lomo_run, is_fused
from lightlike.optimizers.modes import with_modes
from lightlike.pending import LossBuffer, weighted

log = logging.getLogger("lightlike")


class StepContext:
    """What ``training_step(batch, ctx)`` gets (see the module's docstring): ``optimizers`` (in
    the order ``configure_optimizers`` returned them), ``global_step`` (the step being taken,
    counted from 1), ``log_step`` (whether this step writes a log row), ``no_sync()``,
    ``backward(loss)``, ``step(optimizer) -> bool`` and ``clip_gradients(optimizer, max_norm)``.
    One context serves every step of a fit."""

    def __init__(self, *, strategy: Any, model: Any, pairs: list[tuple[Any, Any]], check: NonFiniteCheck,
                 losses: LossBuffer, before_update: Callable[[Any], None], max_norm: float | None,
                 max_value: float | None, log_every: int, max_steps: int):
        self.strategy, self.model, self.check, self.losses = strategy, model, check, losses
        self.optimizers = tuple(o for o, _ in pairs)
        self.schedulers = tuple(s for _, s in pairs)
        self.autocast = strategy.precision.autocast  # the context of a forward pass
        self._before_update = before_update  # calls the callbacks' on_before_optimizer_step
        self._max_norm, self._max_value = max_norm, max_value
        self._log_every, self._max_steps = log_every, max_steps
        self._scaled = strategy.precision.uses_scaler  # each optimizer steps once per step (torch's recipe)
        self._skips, self._raises = check.skip, check.raises  # the nonfinite_loss policy
        self._first = self.optimizers[0] if len(self.optimizers) == 1 else None  # (the usual case, found at once)
        self._modal = with_modes(self.optimizers)  # schedule-free: train mode for every step (optimizers/modes.py)
        self._fused = fused_backward(strategy, self.optimizers)  # LOMO: the update inside backward (optimizers/lomo.py)
        self.global_step = 0
        self._unvetted: list[torch.Tensor] = []  # losses backpropagated since the last vetted update ("skip")
        self._mark = 0  # the loss buffer's length when the step began (a step undone drops what follows)
        self._prepared: list[int] = []  # optimizers whose gradients are averaged and unscaled this step
        self._stepped: list[int] = []  # optimizers stepped this step (under a loss scaler)
        self._norm: torch.Tensor | None = None  # the gradient norm of this step's last update (not vetoed)
        self._applied = False  # some update of this step was applied
        self._skipped: str | None = None  # the cause of this step's first skipped update
        self._veto: str | None = None  # the non-finite check's cause for the update it vetoed

    @property
    def log_step(self) -> bool:
        """Whether this step writes a log row."""
        return self.global_step % self._log_every == 0 or self.global_step >= self._max_steps

    # -- the step's lifetime (the Fitter's) ------------------------------------------------------
    def begin(self, step: int, module: torch.nn.Module) -> None:
        """Start training step ``step`` (from 1)."""
        self.global_step, self._mark = step, len(self.losses.pending)
        self._prepared, self._norm, self._applied, self._skipped = [], None, False, None
        for optimizer in self._modal:
            optimizer.train()
        if self._scaled:
            self._stepped = []
        if self._skips:
            self.check.begin_step(module)

    def finish(self) -> tuple[str | None, torch.Tensor | None]:
        """End the step: update the loss scale once; a step whose every update was skipped is
        counted, and under "skip" undone (buffers back, its losses out of the rows). Returns
        (the cause of a skipped step, else None; the gradient norm to log: one optimizer's, not
        several's, which are not one number)."""
        if self._scaled and self._prepared:
            self.strategy.precision.update_scale()
        norm = self._norm if self._first is not None else None
        cause = self._skipped
        if self._applied or cause is None:
            return None, norm
        self.check.count(cause)
        if cause != "overflow" and self._skips:
            self.losses.drop_last(len(self.losses.pending) - self._mark)
            self.check.undo(self.global_step, cause)
            return cause, None
        return cause, norm

    # -- what a training step calls --------------------------------------------------------------
    def no_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Around a backward that is not the last before ``step`` (accumulation): its gradients
        are not synchronised over the ranks yet (under FSDP: no reduce-scatter, no reshard). With
        ``enabled=False`` the context of the last one."""
        if not enabled:
            return self.strategy.no_sync(self.model, False)
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        strategy, model = self.strategy, self.model
        try:
            with strategy.no_sync(model, True):
                yield
        finally:
            strategy.no_sync(model, False)  # the next backward synchronises again

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` through the strategy (scaled under ``16-mixed``); for LOMO, its
        fused backward-and-update at the scheduler's current rate."""
        if self._fused is not None:
            optimizer, scheduler = self.optimizers[0], self.schedulers[0]
            self._before_update(optimizer)  # (the update happens inside this backward: no gradients to see)
            lr = scheduler.get_last_lr()[0] if scheduler is not None else optimizer.param_groups[0]["lr"]
            self._norm = self._fused(loss, lr)
            return
        if self._skips:
            self._unvetted.append(loss.detach())
        self.strategy.backward(loss, self.model)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to the global norm ``max_norm``; returns the norm before
        clipping (a device tensor)."""
        from lightlike.strategies.base import clip_gradients

        self._prepare(optimizer, self._index(optimizer))
        return clip_gradients(optimizer, max_norm, None)  # type: ignore[return-value]

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Average, unscale, clip, check, step and zero ``optimizer``'s gradients; step its
        scheduler when the update was applied. Returns whether it was."""
        i = 0 if optimizer is self._first else self._index(optimizer)
        if self._fused is not None:  # LOMO updated inside backward: its scheduler steps
            return self._fused_step()
        if self._scaled:
            self._once(i)
        if i not in self._prepared:  # (ctx.clip_gradients may have prepared them)
            self._prepared.append(i)
            self.strategy.prepare_gradients(optimizer)
        result = self.strategy.step(optimizer, self.model, self._max_norm, self._max_value, self._vet)
        optimizer.zero_grad(set_to_none=True)
        norm = result.grad_norm
        if norm is None:  # vetoed by the non-finite check
            return self._skip(self._veto, i)  # type: ignore[arg-type]
        self._norm = norm
        if self._raises and not result.overflow:
            self.losses.add_norm(norm, self.global_step)  # "raise": checked at the next read
        if not result.applied:
            return self._skip("overflow" if result.overflow else "gradient", i)
        self._applied = True
        scheduler = self.schedulers[i]
        if scheduler is not None:
            scheduler.step()
        return True

    # -- inside -------------------------------------------------------------------------------
    def _fused_step(self) -> bool:
        if self._raises and self._norm is not None:
            self.losses.add_norm(self._norm, self.global_step)  # "raise": checked at the next read
        self._applied = True
        if self.schedulers[0] is not None:
            self.schedulers[0].step()
        return True

    def _index(self, optimizer: Any) -> int:
        for i, o in enumerate(self.optimizers):
            if o is optimizer:
                return i
        raise ModuleContractError("ctx.step/ctx.clip_gradients got an optimizer that configure_optimizers did not "
                                  "return: use the ones in ctx.optimizers")

    def _once(self, i: int) -> None:
        """Under a loss scaler, optimizer ``i`` steps once per training step (torch's recipe)."""
        if i in self._stepped:
            raise ModuleContractError(f"ctx.step(optimizer {i}) was called twice in one training_step under "
                                      f"precision={self.strategy.precision.name!r}: torch's GradScaler recipe steps "
                                      "each optimizer once per update; step it once per training_step")
        self._stepped.append(i)

    def _prepare(self, optimizer: torch.optim.Optimizer, i: int) -> None:
        """The optimizer's gradients averaged over the ranks (where backward did not) and
        unscaled, once per step."""
        if i not in self._prepared:
            self._prepared.append(i)
            self.strategy.prepare_gradients(optimizer)

    def _vet(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor | None) -> bool:
        """``Strategy.step``'s question before the update: under "skip", whether the losses
        backpropagated since the last update and ``norm`` are finite on every rank; then the
        callbacks' ``on_before_optimizer_step``. False vetoes the update."""
        if self._skips:
            self._veto = self.check.vet(self._unvetted, norm)
            self._unvetted = []
            if self._veto is not None:
                return False
        self._before_update(optimizer)
        return True

    def _skip(self, cause: str, i: int) -> bool:
        if self._skipped is None:
            self._skipped = cause
        if self._first is None and cause != "overflow":
            log.warning("non-finite %s at step %d: the update of optimizer %d (of ctx.optimizers) skipped",
                        cause, self.global_step, i)
        return False


def fused_backward(strategy: Any, optimizers: tuple[Any, ...]) -> FusedBackward | None:
    """LOMO's fused backward-and-update, where the optimizer is LOMO (what cannot work with it
    refused here, at set-up)."""
    if not any(is_fused(o) for o in optimizers):
        return None
    check_lomo_run(strategy, optimizers)
    return FusedBackward(optimizers[0])


class AutomaticStep:
    """The training step of a module with ``forward`` + ``loss``: micro-batch i of the window is
    weighted by ``items_i / items_in_step``, so the step's gradient is that of the mean loss over
    every item of the step, whatever each micro-batch holds (all ranks: the strategy's
    ``item_normaliser``)."""

    def __init__(self, module: Any, forward_loss: Callable[..., torch.Tensor], count_items: Callable[[Any], Any],
                 uniform_counts: bool):
        self.module, self.forward_loss, self.count_items = module, forward_loss, count_items
        self.uniform_counts = uniform_counts  # every rank holds the same integer counts (no reduction)

    def __call__(self, window: list[Any], ctx: StepContext) -> None:
        module, forward_loss, step, record = self.module, self.forward_loss, ctx.global_step, ctx.losses.add
        counts = [self.count_items(b) for b in window]
        normaliser = ctx.strategy.item_normaliser(counts, uniform=self.uniform_counts)
        last = len(window) - 1
        for i, batch in enumerate(window):
            with ctx.no_sync(i < last):
                with ctx.autocast():
                    loss = forward_loss(ctx.model, module, batch, "at step {}, micro-batch {}", step, i)
                ctx.backward(weighted(loss, counts[i], normaliser.total))
            record(loss, counts[i], step, i)  # for the rows (taken back out if the step is undone)
        ctx.step(ctx.optimizers[0])

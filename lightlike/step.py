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
import functools
import logging
import math
import numbers
import warnings
import weakref
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
    One context serves every step of a fit; a module's own ``training_step`` gets a
    ``ManualStepContext``, which also checks how it is used."""

    def __init__(self, *, strategy: Any, model: Any, pairs: list[tuple[Any, Any]], check: NonFiniteCheck,
                 losses: LossBuffer, before_update: Callable[[Any], None] | None, max_norm: float | None,
                 max_value: float | None, log_every: int, max_steps: int):
        self.strategy, self.model, self.check, self.losses = strategy, model, check, losses
        self.optimizers = tuple(o for o, _ in pairs)
        self.schedulers = tuple(s for _, s in pairs)
        self.autocast = strategy.precision.autocast  # the context of a forward pass
        self._before_update = before_update  # the callbacks' on_before_optimizer_step (None: nobody listens)
        self._unchecked = strategy.gradients_on_parameters  # whether the loss reaches the parameters: at the first update
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
        self._stepped: list[int] = []  # optimizers stepped this step (under a loss scaler)
        self._norm: torch.Tensor | None = None  # the gradient norm of this step's last update (not vetoed)
        self._applied = False  # some update of this step was applied
        self._skipped: str | None = None  # the cause of this step's first skipped update
        self._veto: str | None = None  # the non-finite check's cause for the update it vetoed
        self._prepares = 0  # how many times this step prepared (averaged, unscaled) an optimizer's gradients

    @property
    def log_step(self) -> bool:
        """Whether this step writes a log row."""
        return self.global_step % self._log_every == 0 or self.global_step >= self._max_steps

    # -- the step's lifetime (the Fitter's) ------------------------------------------------------
    def begin(self, step: int, module: torch.nn.Module) -> None:
        """Start training step ``step`` (from 1)."""
        self.global_step, self._prepares = step, 0
        self._norm, self._applied, self._skipped = None, False, None
        for optimizer in self._modal:
            optimizer.train()
        if self._scaled:
            self._stepped = []
        if self._skips:
            self._mark = len(self.losses.pending)
            self.check.begin_step(module)

    def finish(self) -> tuple[str | None, torch.Tensor | None]:
        """End the step: update the loss scale once; a step whose every update was skipped is
        counted, and under "skip" undone (buffers back, its losses out of the rows). Returns
        (the cause of a skipped step, else None; the gradient norm to log: one optimizer's, not
        several's, which are not one number)."""
        if self._scaled and self._prepares:
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

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of ``loss`` through the strategy (scaled under ``16-mixed``); ``retain_graph``
        keeps the graph for another backward through it (Lightning's ``manual_backward(loss,
        retain_graph=True)``). For LOMO, its fused backward-and-update at the scheduler's current rate."""
        if self._fused is not None:
            optimizer, scheduler = self.optimizers[0], self.schedulers[0]
            if self._before_update is not None:  # (the update happens inside this backward: no gradients to see)
                self._before_update(optimizer)
            lr = scheduler.get_last_lr()[0] if scheduler is not None else optimizer.param_groups[0]["lr"]
            self._norm = self._fused(loss, lr)
            return
        if self._skips:
            self._unvetted.append(loss.detach())
        self.strategy.backward(loss, self.model, retain_graph)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Average, unscale, clip, check, step and zero ``optimizer``'s gradients; step its
        scheduler when the update was applied. Returns whether it was."""
        i = 0 if optimizer is self._first else self._index(optimizer)
        if self._fused is not None:  # LOMO updated inside backward: its scheduler steps
            return self._fused_step()
        if self._scaled:
            self._once(i)
        self._prepares += 1
        self.strategy.prepare_gradients(optimizer, (self.global_step, i))
        return self._update(optimizer, i)

    # -- inside -------------------------------------------------------------------------------
    def _fused_step(self) -> bool:
        if self._raises and self._norm is not None:
            self.losses.add_norm(self._norm, self.global_step)  # "raise": checked at the next read
        self._applied = True
        if self.schedulers[0] is not None:
            self.schedulers[0].step()
        return True

    def _update(self, optimizer: torch.optim.Optimizer, i: int) -> bool:
        """The strategy's step of prepared gradients, then zeroed; the scheduler steps after an
        applied update. Returns whether it was applied."""
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

    def _vet(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor | None) -> bool:
        """``Strategy.step``'s question before the update: under "skip", whether the losses
        backpropagated since the last update and ``norm`` are finite on every rank; then the
        callbacks' ``on_before_optimizer_step``. False vetoes the update."""
        if self._skips:
            self._veto = self.check.vet(self._unvetted, norm)
            self._unvetted = []
            if self._veto is not None:
                return False
        if self._unchecked:
            self._unchecked = False
            self._warn_if_unreached(optimizer)
        if self._before_update is not None:
            self._before_update(optimizer)
        return True

    def _warn_if_unreached(self, optimizer: torch.optim.Optimizer) -> None:
        """At the first update: a loss that reaches none of the optimizer's parameters (layers
        kept in a plain list, so not registered; outputs detached) trains nothing, for a whole
        run, without an error. Said once (main process). ``p.grad is None`` is read on the host:
        no device sync."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if params and self.strategy.is_global_zero and all(p.grad is None for p in params):
            log.warning("no gradient reached any of the optimizer's %d trainable parameters at step %d: the loss is "
                        "not connected to them, so training changes nothing. Compute loss() from forward()'s "
                        "outputs without .detach(), with layers the module registers (in a plain list or dict they "
                        "are not: use nn.ModuleList or nn.ModuleDict)", len(params), self.global_step)

    def _skip(self, cause: str, i: int) -> bool:
        if self._skipped is None:
            self._skipped = cause
        if self._first is None and cause != "overflow":
            log.warning("non-finite %s at step %d: the update of optimizer %d (of ctx.optimizers) skipped",
                        cause, self.global_step, i)
        return False


class ManualStepContext(StepContext):
    """The step context of a module's own ``training_step`` (manual optimization): the same
    step, with its misuse checked: a context used after its step, ``ctx.step`` without
    gradients, an optimizer or scheduler stepped outside ``ctx.step``, ``ctx.backward`` without
    a ``ctx.step``, and under DDP the ranks' agreement on their ``ctx.step`` calls."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._live = False  # inside a training step (a context used after its step is an error)
        self._updating = False  # inside ctx.step's update (an optimizer stepped outside it was stepped directly)
        self._backwards, self._steps = 0, 0  # this step's ctx.backward and ctx.step calls
        self._warned: set[Any] = set()  # the misuse warnings given (each once per fit)
        self._scheduler_seen: dict[int, Any] = {}  # each scheduler's last_epoch after ctx.step stepped it
        self._prepared: list[int] = []  # optimizers whose gradients are averaged and unscaled since their update
        if self._fused is None:  # (LOMO updates inside backward)
            for i, o in enumerate(self.optimizers):
                if isinstance(o, torch.optim.Optimizer):
                    o.register_step_pre_hook(functools.partial(_stepped_directly, weakref.ref(self), i))

    def begin(self, step: int, module: torch.nn.Module) -> None:
        super().begin(step, module)
        self._live, self._backwards, self._steps, self._prepared = True, 0, 0, []

    def finish(self) -> tuple[str | None, torch.Tensor | None]:
        self._live = False
        self._end_manual_step()
        return super().finish()

    def no_sync(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        self._check_live("ctx.no_sync()")
        return super().no_sync(enabled)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self._check_live("ctx.backward(loss)")
        self._backwards += 1
        super().backward(loss, retain_graph)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        self._check_live("ctx.step(optimizer)")
        i = self._index(optimizer)
        self._steps += 1
        if self._fused is not None:  # LOMO updated inside backward: its scheduler steps
            return self._fused_step()
        if self._scaled:
            self._once(i)
        if i not in self._prepared and not _has_gradients(optimizer) and not self._averages_at_step():
            return self._no_gradients(i)  # (nothing to unscale: another rank's count only if ctx.step averages)
        self._prepare(optimizer, i)
        if not _has_gradients(optimizer):
            self._prepared.remove(i)
            return self._no_gradients(i)
        self._check_scheduler(i)
        self._updating = True  # (an error below ends the fit, and this context with it)
        applied = self._update(optimizer, i)
        self._updating = False
        self._prepared.remove(i)  # (a second ctx.step of it in this training step averages its new gradients)
        self._scheduler_seen[i] = getattr(self.schedulers[i], "last_epoch", None)
        return applied

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to the global norm ``max_norm``; returns the norm before
        clipping (a device tensor)."""
        from lightlike.strategies.base import clip_gradients

        self._check_live("ctx.clip_gradients(optimizer, max_norm)")
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or math.isnan(max_norm) \
                or max_norm <= 0:
            raise ModuleContractError(f"ctx.clip_gradients(optimizer, max_norm={max_norm!r}) at step "
                                      f"{self.global_step}: max_norm must be a number > 0 (a negative one would flip "
                                      "the gradients' sign, 0 would zero them; inf clips nothing)")
        self._prepare(optimizer, self._index(optimizer))
        return clip_gradients(optimizer, max_norm, None)  # type: ignore[return-value]

    def _prepare(self, optimizer: torch.optim.Optimizer, i: int) -> None:
        """The optimizer's gradients averaged over the ranks (where backward did not) and
        unscaled, once per step."""
        if i not in self._prepared:
            self._prepared.append(i)
            self._prepares += 1
            self.strategy.prepare_gradients(optimizer, (self.global_step, i))

    def _check_scheduler(self, i: int) -> None:
        """Before ``ctx.step``'s update: a scheduler the module stepped itself since the last
        one (Lightning leaves that to the module) is said once: it steps twice per update."""
        seen = self._scheduler_seen.get(i)
        if seen is not None and getattr(self.schedulers[i], "last_epoch", seen) != seen:
            self._warn_once(("scheduler", i), f"the scheduler of ctx.optimizers[{i}] was stepped outside ctx.step "
                            f"(before step {self.global_step}): ctx.step already steps it after each applied update, "
                            "so it now steps twice; remove the module's own scheduler.step() (Lightning's manual "
                            "optimization leaves it to the module, lightlike does not)")

    def _end_manual_step(self) -> None:
        """The end of a module's own training step: under DDP the ranks agree they took the same
        ``ctx.step`` calls; a ``ctx.backward`` without any ``ctx.step`` is said once."""
        if self._averages_at_step():
            self.strategy.step_agreement.end_step(self.global_step, self._prepares)
        if self._backwards and not self._steps and self._fused is None:
            self._warn_once("kept", f"training_step {self.global_step} called ctx.backward but no ctx.step: its "
                            "gradients are kept and add to the next backward's, and nothing was updated. Call "
                            "ctx.step(optimizer) after ctx.backward in the same training_step (to accumulate over "
                            "several batches, backpropagate them all inside one training_step)")

    def _averages_at_step(self) -> bool:
        """Whether ``ctx.step`` averages the gradients over several ranks (manual DDP)."""
        return getattr(self.strategy, "step_agreement", None) is not None

    def _check_live(self, call: str) -> None:
        if not self._live:
            raise ModuleContractError(f"{call} was called on the step context of step {self.global_step} after that "
                                      "training_step returned: use ctx only inside training_step (keep no reference "
                                      "to it in a callback, an evaluation or a later step)")

    def _no_gradients(self, i: int) -> bool:
        """``ctx.step`` of an optimizer none of whose parameters has a gradient (on any rank):
        nothing to update, its scheduler does not step; said once."""
        self._warn_once(("empty", i), f"ctx.step(ctx.optimizers[{i}]) at step {self.global_step}: none of its "
                        "parameters has a gradient (no ctx.backward reached them since its last step), so nothing "
                        "was updated and ctx.step returned False; call ctx.backward on a loss that depends on them "
                        "first, or leave out this ctx.step")
        return False

    def _warn_once(self, key: Any, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return True
    return False


def _stepped_directly(ref: Any, i: int, optimizer: Any, args: Any, kwargs: Any) -> None:
    """An optimizer's step pre-hook: a step inside a training step but outside ``ctx.step``
    bypassed it. Under DDP's manual optimization (gradients averaged by ``ctx.step``) an error,
    before the ranks' weights part; elsewhere a warning, once."""
    ctx = ref()
    if ctx is None or not ctx._live or ctx._updating:
        return
    ctx._steps += 1  # (an update, if not ctx.step's)
    averages = ctx._averages_at_step()
    skipped = ("gradient clipping (max_grad_norm, max_grad_value), the non-finite check, on_before_optimizer_step, "
               "zeroing the gradients and its scheduler's step")
    if ctx._scaled:
        skipped = f"unscaling the gradients ({ctx.strategy.precision.name}), {skipped}"
    message = (f"ctx.optimizers[{i}].step() was called directly in training_step {ctx.global_step}: that bypasses "
               f"ctx.step, so {{}}{skipped} were skipped. Call ctx.step(optimizer) instead (Lightning's opt.step() "
               "in manual optimization does what ctx.step does; a raw torch optimizer's does not)")
    if averages:
        raise ModuleContractError(message.format("averaging the gradients over the ranks (each rank's weights would "
                                                 "differ), "))
    ctx._warn_once(("direct", i), message.format(""))


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
    ``item_normaliser``). A window of one micro-batch whose count is the same on every rank
    (``uniform_counts``) has weight 1 on any strategy: its loss is the step's mean as it is."""

    def __init__(self, module: Any, forward_loss: Callable[..., torch.Tensor], count_items: Callable[[Any], Any],
                 uniform_counts: bool):
        self.module, self.forward_loss, self.count_items = module, forward_loss, count_items
        self.uniform_counts = uniform_counts  # every rank holds the same integer counts (no reduction)

    def __call__(self, window: list[Any], ctx: StepContext) -> None:
        module, forward_loss, step, record = self.module, self.forward_loss, ctx.global_step, ctx.losses.add
        counts = list(map(self.count_items, window))
        last = len(window) - 1
        normaliser = None if last == 0 and self.uniform_counts else \
            ctx.strategy.item_normaliser(counts, uniform=self.uniform_counts)
        for i, batch in enumerate(window):
            with ctx.no_sync(i < last):
                with ctx.autocast():
                    loss = forward_loss(ctx.model, module, batch, "at step {}, micro-batch {}", step, i)
                ctx.backward(loss if normaliser is None else weighted(loss, counts[i], normaliser.total))
            record(loss, counts[i], step, i)  # for the rows (taken back out if the step is undone)
        ctx.step(ctx.optimizers[0])

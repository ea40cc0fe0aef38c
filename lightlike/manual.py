"""Manual optimization: a ``TaskModule`` that defines ``training_step(batch, ctx)`` runs its own
step (several optimizers, several backward passes: GANs, actor-critic, SAM) with the Fitter's
data, logging, evaluation, checkpoints and resume around it.

What ``ctx`` (a ``StepContext``) does, and why:

- ``ctx.backward(loss)``: the precision plugin's backward (``16-mixed`` scales the loss). Under
  DDP no gradient is synchronised here: each optimizer's gradients are averaged over the ranks
  when ``ctx.step`` (or ``ctx.clip_gradients``) first reads them
  (``Strategy.average_manual_gradients``, one all-reduce per dtype). Averaging is linear, so
  gradients summed from several backward passes are averaged exactly once, whichever parameters
  each pass touched (DDP's reducer, made for one backward over every parameter per step, is not
  used: no hang, no ``find_unused_parameters``). FSDP reduce-scatters in each backward, as usual.
- ``ctx.step(optimizer)``: average over ranks, unscale, clip (``max_grad_norm``,
  ``max_grad_value``), check the global gradient norm (``nonfinite_loss``), call the callbacks'
  ``on_before_optimizer_step``, step, zero that optimizer's gradients, and step its scheduler when
  the update was applied. Returns False when the update was skipped (a ``16-mixed`` overflow; a
  non-finite gradient under ``nonfinite_loss="skip"``).
- ``16-mixed`` follows torch's multi-optimizer AMP recipe: ONE ``GradScaler`` for all optimizers,
  ``scaler.step(optimizer)`` per optimizer, one ``scaler.update()`` at the end of the training step.
  So each optimizer steps at most once per training step under ``16-mixed``.
- ``ctx.no_sync()``: around a backward that is not the last before ``ctx.step`` (accumulation):
  nothing to do under DDP (gradients are averaged at ``ctx.step``); under FSDP no reduce-scatter.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightlike import optim
from lightlike.config import field_defaults
from lightlike.errors import ConfigError, ModuleContractError
from lightlike.precision import Precision
from lightlike.strategies.base import clip_gradients

log = logging.getLogger("lightlike")

_NO_UNSCALE = Precision()  # clip_gradients' unscale step is done once per optimizer by StepContext


def is_manual(module: Any) -> bool:
    """Whether ``module`` optimizes itself: it defines ``training_step(batch, ctx)``."""
    return callable(getattr(module, "training_step", None))


def check_manual_config(config: Any) -> None:
    """The built-in optimizer's and scheduler's fields, ``grad_accum_steps`` and ``compile`` do not
    apply to a module that steps its own optimizers: set away from their defaults, they are an
    error naming the field (silently unused, they would mislead)."""
    defaults = field_defaults(type(config))
    for name in optim.OPTIMIZER_FIELDS:
        if getattr(config, name) != defaults[name]:
            raise ConfigError(f"{name}={getattr(config, name)!r} configures the built-in optimizer or scheduler, "
                              "which a module with training_step (manual optimization) does not use: set it on the "
                              "optimizers configure_optimizers returns, and drop it from the config")
    if config.grad_accum_steps != 1:
        raise ConfigError(f"grad_accum_steps={config.grad_accum_steps} does not apply to manual optimization (a "
                          "module with training_step): accumulate inside training_step (several ctx.backward "
                          "calls, under ctx.no_sync(), before one ctx.step), and drop grad_accum_steps")
    if config.compile:
        raise ConfigError("compile=True compiles the module's forward and loss of automatic optimization; a module "
                          "with training_step calls its submodules itself: torch.compile them there, and drop compile")


def unwrap_manual_optimizers(result: Any) -> list[tuple[torch.optim.Optimizer, Any]]:
    """What ``configure_optimizers`` returned for a manual module, as ``[(optimizer, scheduler or
    None), ...]`` in its order: one optimizer (or pair, or dict), or a list of optimizers,
    ``(optimizer, scheduler)`` pairs and ``{"optimizer", "lr_scheduler"}`` dicts."""
    if result is None:
        raise ModuleContractError("a module with training_step (manual optimization) must return its optimizers "
                                  "from configure_optimizers(config): a list of optimizers, (optimizer, scheduler) "
                                  "pairs or {'optimizer': ..., 'lr_scheduler': ...} dicts")
    if isinstance(result, (list, tuple)) and result \
            and all(isinstance(x, (torch.optim.Optimizer, list, tuple, Mapping)) for x in result):
        entries = list(result)  # several entries (a pair's second item is a scheduler or None)
    else:
        entries = [result]
    pairs = [optim.unwrap_configure_optimizers(e) for e in entries]
    seen: set[int] = set()
    for opt, _ in pairs:
        for p in (p for g in opt.param_groups for p in g["params"]):
            if id(p) in seen:
                raise ModuleContractError("configure_optimizers returned two optimizers over one parameter: each "
                                          "parameter belongs to one optimizer in manual optimization")
            seen.add(id(p))
    return pairs


def set_up(fitter: Any, module: Any, strategy: Any) -> tuple[Any, ManualTraining]:
    """The module as the strategy sets it up for manual optimization, then its optimizers (built
    over the parameters set up), as ``(model, ManualTraining)``."""
    check_manual_config(fitter.config)
    model = strategy.setup_manual_module(module)
    pairs = unwrap_manual_optimizers(optim.call_configure_optimizers(module, fitter.config))
    return model, ManualTraining(fitter, pairs)


class ManualOptimizers:
    """The optimizers of a manual module as one object for the checkpoint (``optimizer.pt``
    holds ``{"optimizers": [state of each, in order]}``) and for logging (``param_groups``: all
    of them, the first optimizer's first)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        """The optimizers: torch's distributed checkpoint (FSDP) takes them as an iterable."""
        return iter(self.optimizers)

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            what = f"{len(saved)} optimizers" if isinstance(saved, list) else "one (automatic) optimizer"
            raise ConfigError(f"the checkpoint's optimizer state holds {what}; this module's configure_optimizers "
                              f"returns {len(self.optimizers)}: resume with the module that wrote it")
        for o, s in zip(self.optimizers, saved, strict=True):
            o.load_state_dict(s)


class ManualSchedulers:
    """The schedulers of a manual module as one object for the checkpoint (``scheduler.pt``) and
    for logging (``get_last_lr``: each optimizer's current rate, the first optimizer's first)."""

    def __init__(self, pairs: list[tuple[torch.optim.Optimizer, Any]]):
        self.pairs = pairs

    def get_last_lr(self) -> list[float]:
        return [s.get_last_lr()[0] if s is not None else o.param_groups[0]["lr"] for o, s in self.pairs]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() if s is not None else None for _, s in self.pairs]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for (_, s), saved in zip(self.pairs, state["schedulers"], strict=True):
            if s is not None:
                s.load_state_dict(saved)


class ManualTraining:
    """One fit's manual optimization: runs ``module.training_step`` once per training step,
    with a ``StepContext``, and keeps what it returned for the log rows."""

    def __init__(self, fitter: Any, pairs: list[tuple[torch.optim.Optimizer, Any]]):
        self.fitter, self.pairs = fitter, pairs
        self.optimizers = ManualOptimizers([o for o, _ in pairs])
        self.schedulers = ManualSchedulers(pairs) if any(s is not None for _, s in pairs) else None
        self.extra: dict[str, torch.Tensor] = {}  # the last step's values other than "loss"

    def run_step(self, run: Any, window: list[Any], step: int) -> None:
        """Training step ``step`` on ``window``'s one batch."""
        fitter, strategy = self.fitter, self.fitter.strategy
        batch = strategy.batch_to_device(window[0])
        ctx = StepContext(self, run, step)
        run.nonfinite.begin_step(run.module)
        with strategy.autocast():
            out = run.module.training_step(batch, ctx)
        ctx.finish()
        loss, extra = _read_output(out, step)
        run.losses.add(loss, run.count_items(batch), step, 0)
        self.extra = extra
        if ctx.skipped and not ctx.applied:  # every update this step tried was skipped: so was the step
            run.nonfinite.causes[ctx.skipped[0]] += 1
            fitter.state.skipped_steps += 1

    def take_logged(self, strategy: Any) -> dict[str, float]:
        """``train/<key>``: each value the last ``training_step`` returned besides ``loss``, its mean
        over the ranks; read at a log row. (``train/loss`` is the item-weighted mean since the last
        row, as in automatic optimization.) Only the last step's values are kept, so a checkpoint
        needs none of them: a resumed run logs the same rows."""
        if not self.extra:
            return {}
        keys = sorted(self.extra)
        means = torch.stack([self.extra[k].double() for k in keys])
        means = strategy.collectives.all_reduce(means) / strategy.world_size
        self.extra = {}
        return {f"train/{k}": float(v) for k, v in zip(keys, means.tolist(), strict=True)}


def _read_output(out: Any, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``training_step``'s return: a scalar tensor (the loss), or a dict of scalars with ``loss``."""
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.detach().reshape(()), {}
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        values = {}
        for key, v in out.items():
            if not (isinstance(v, torch.Tensor) and v.numel() == 1):
                raise ModuleContractError(f"training_step returned {{{key!r}: {type(v).__name__}}} at step {step}; "
                                          "every value must be a scalar tensor (logged as train/<key>)")
            values[str(key)] = v.detach().reshape(())
        return values.pop("loss"), values
    raise ModuleContractError(f"training_step returned {type(out).__name__} at step {step}; return a scalar tensor "
                              "(the loss) or a dict of scalar tensors with a 'loss' key (each logged as train/<key>)")


class StepContext:
    """What ``training_step(batch, ctx)`` gets (see the module's docstring): ``optimizers`` (in
    the order ``configure_optimizers`` returned them), ``global_step`` (the step being taken,
    counted from 1), ``log_step`` (whether this step writes a log row), ``no_sync()``,
    ``backward(loss)``, ``step(optimizer) -> bool`` and ``clip_gradients(optimizer, max_norm)``."""

    def __init__(self, training: ManualTraining, run: Any, step: int):
        self._training, self._run = training, run
        self._fitter = training.fitter
        self._strategy = self._fitter.strategy
        cfg = self._fitter.config
        self.optimizers = tuple(o for o, _ in training.pairs)
        self.global_step = step
        self.log_step = step % cfg.log_every == 0 or step >= run.max_steps
        self._prepared: set[int] = set()  # optimizers whose gradients are averaged and unscaled
        self._stepped: set[int] = set()
        self.skipped: list[str] = []  # causes of the updates skipped this step
        self.applied = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Around a backward that is not the last before ``step``. Under DDP gradients are
        averaged at ``step`` only, so this does nothing; under FSDP the backward passes inside it
        neither reduce-scatter nor reshard (the strategy's ``no_sync``), the next one outside does."""
        strategy, model = self._strategy, self._run.model
        try:
            with strategy.no_sync(model, enabled=True):
                yield
        finally:
            strategy.no_sync(model, enabled=False)  # the next backward synchronises again

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` through the precision plugin (scaled under ``16-mixed``)."""
        self._strategy.precision.backward(loss)

    def _index(self, optimizer: Any) -> int:
        for i, o in enumerate(self.optimizers):
            if o is optimizer:
                return i
        raise ModuleContractError("ctx.step/ctx.clip_gradients got an optimizer that configure_optimizers did not "
                                  "return: use the ones in ctx.optimizers")

    def _prepare(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Average the optimizer's gradients over the ranks and unscale them, once per step call."""
        i = self._index(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if i not in self._prepared:
            self._prepared.add(i)
            self._strategy.average_manual_gradients(params)
            self._strategy.precision.unscale_gradients(optimizer)
        return params

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip ``optimizer``'s gradients to the global norm ``max_norm``; returns the norm before
        clipping (a device tensor)."""
        self._prepare(optimizer)
        return clip_gradients(_NO_UNSCALE, optimizer, max_norm, None)  # type: ignore[return-value]

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Average, unscale, clip, check, step and zero ``optimizer``'s gradients; step its
        scheduler when the update was applied. Returns whether it was."""
        i = self._index(optimizer)
        precision, cfg, fitter = self._strategy.precision, self._fitter.config, self._fitter
        if precision.uses_scaler and i in self._stepped:
            raise ModuleContractError(f"ctx.step(optimizer {i}) was called twice in one training_step under "
                                      f"precision={precision.name!r}: torch's GradScaler recipe steps each optimizer "
                                      "once per update; step it once per training_step")
        self._stepped.add(i)
        self._prepare(optimizer)
        norm = clip_gradients(_NO_UNSCALE, optimizer, cfg.max_grad_norm, cfg.max_grad_value, want_norm=True)
        check = self._run.nonfinite
        if check.skip and check.checks_norm and not bool(torch.isfinite(norm)):  # "skip": one read per ctx.step
            optimizer.zero_grad(set_to_none=True)
            self.skipped.append("gradient")
            log.warning("non-finite gradient at step %d: the update of optimizer %d (of ctx.optimizers) skipped",
                        self.global_step, i)
            return False
        fitter.callbacks.call("on_before_optimizer_step", fitter, fitter.state, fitter.control, optimizer)
        stepped = precision.step_without_update(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if not check.skip and check.checks_norm and norm is not None:
            self._run.losses.add_norm(norm, self.global_step)  # "raise": checked at the next read
        if not stepped:
            self.skipped.append("overflow")
            return False
        self.applied = True
        scheduler = self._training.pairs[i][1]
        if scheduler is not None:
            scheduler.step()
        return True

    def finish(self) -> None:
        """The end of the training step: the loss scale is updated once (torch's recipe)."""
        if self._prepared:
            self._strategy.precision.update_scale()

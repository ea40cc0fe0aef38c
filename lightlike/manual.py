"""Manual optimization: a ``TaskModule`` that defines ``training_step(batch, ctx)`` runs its own
step (several optimizers, several backward passes: GANs, actor-critic, SAM) with the Fitter's
data, logging, evaluation, checkpoints and resume around it.

``ctx`` is the ``StepContext`` of ``lightlike/step.py``, the one automatic optimization uses too;
its docstring says what each call does. What differs here:

- Under DDP the module is not wrapped in ``DistributedDataParallel``: each optimizer's gradients
  are averaged over the ranks when ``ctx.step`` (or ``ctx.clip_gradients``) first reads them
  (``Strategy.prepare_gradients``, one all-reduce per dtype). Averaging is linear, so gradients
  summed from several backward passes are averaged exactly once, whichever parameters each pass
  touched (DDP's reducer, made for one backward over every parameter per step, is not used: no
  hang, no ``find_unused_parameters``). A rank without a gradient another rank has contributes
  zeros, and the ranks agree on each ``ctx.step`` before its all-reduce
  (``lightlike/strategies/agreement.py``). FSDP reduce-scatters in each backward, as usual.
- ``16-mixed`` follows torch's multi-optimizer AMP recipe: ONE ``GradScaler`` for all optimizers,
  ``scaler.step(optimizer)`` per optimizer, one ``scaler.update()`` at the end of the training step.
  So each optimizer steps at most once per training step under ``16-mixed``.
- The loss ``training_step`` returns is the step's loss in the training rows; the other scalars it
  returns are logged as ``train/<key>``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightlike import optim
from lightlike.config import field_defaults
from lightlike.errors import ConfigError, ModuleContractError


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


def set_up(config: Any, module: Any, strategy: Any) -> tuple[Any, list[tuple[torch.optim.Optimizer, Any]]]:
    """The module as the strategy sets it up for manual optimization, then its optimizers (built
    over the parameters set up) with their schedulers, as ``(model, [(optimizer, scheduler), ...])``."""
    check_manual_config(config)
    model = strategy.setup_module(module, manual=True)
    pairs = unwrap_manual_optimizers(optim.call_configure_optimizers(module, config))
    warn_untrained(model, pairs)
    return model, pairs


def warn_untrained(model: torch.nn.Module, pairs: list[tuple[torch.optim.Optimizer, Any]]) -> None:
    """A warning naming a few trainable parameters (``requires_grad``) that no optimizer holds:
    they would never change."""
    held = {id(p) for opt, _ in pairs for g in opt.param_groups for p in g["params"]}
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        shown = ", ".join(repr(n) for n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        warnings.warn(f"{len(left)} trainable parameter(s) are in no optimizer configure_optimizers returned, so "
                      f"training never changes them: {shown}. Add them to an optimizer, or freeze them "
                      "(requires_grad_(False)) if that is what you mean", stacklevel=3)


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


class ManualStep:
    """The training step of a module with ``training_step(batch, ctx)``: one batch per step; keeps
    the scalars it returned besides the loss for the log rows."""

    def __init__(self, module: Any, count_items: Any, pairs: list[tuple[torch.optim.Optimizer, Any]]):
        self.module, self.count_items, self.pairs = module, count_items, pairs
        self.optimizers = ManualOptimizers([o for o, _ in pairs])
        self.schedulers = ManualSchedulers(pairs) if any(s is not None for _, s in pairs) else None
        self.extra: dict[str, torch.Tensor] = {}  # the last step's values other than "loss"

    def __call__(self, window: list[Any], ctx: Any) -> None:
        batch = window[0]
        with ctx.autocast():
            out = self.module.training_step(batch, ctx)
        loss, self.extra = _read_output(out, ctx.global_step)
        ctx.losses.add(loss, self.count_items(batch), ctx.global_step, 0)

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

"""Built-in optimizers and learning-rate schedules (the HF Trainer's formulas).

Schedules are ``LambdaLR`` over module-level functions bound with ``functools.partial``, so a
scheduler's ``state_dict()`` holds only plain values (``last_epoch``, ``base_lrs``, ...) and
loads with ``torch.load(weights_only=True)``. The partial's arguments (warmup, total steps, ...)
are *not* in the state: a resumed run rebuilds the scheduler from its config and total steps,
then loads the state. The scheduler is stepped once per applied optimizer step;
``scheduler.get_last_lr()`` after ``k`` steps is ``learning_rate * factor(k)``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from lightlike import lr_schedulers, schedules
from lightlike.config import OPTIMIZERS, SCHEDULERS, field_defaults
from lightlike.errors import ConfigError, ModuleContractError
from lightlike.lr_schedulers import check_epoch_budget  # noqa: F401  (the Fitter's, at set-up)
from lightlike.optimizers import (
    GALORE_ARGUMENTS,
    LIBRARY_OPTIMIZERS,
    class_label,
    optimizer_arguments,
    optimizer_class,
)
from lightlike.optimizers.libraries import check_device
from lightlike.precision import get_precision
from lightlike.schedules import step_on_epoch_end, step_on_evaluation  # noqa: F401  (the Fitter's)

log = logging.getLogger("lightlike")

#: Modules whose own parameters never get weight decay (besides biases and 1-D parameters).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


#: parameter names (lower-cased) that never decay: the HF Trainer's patterns
#: (``Trainer.get_decay_parameter_names``), so a run moved from it decays the same parameters
NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


# -- optimizers ------------------------------------------------------------------------------------
def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split the trainable parameters into ``[decay, no_decay]`` groups (HF Trainer's rule, and
    every 1-D parameter).

    No decay: every parameter whose lower-cased name matches one of HF's patterns
    (``NO_DECAY_NAMES``: ``bias`` anywhere in the name, so T5's ``relative_attention_bias`` and
    Swin's ``relative_position_bias_table`` too; ``layernorm``, ``rmsnorm``, a ``norm`` or
    ``*_norm`` module), every parameter owned by a normalisation layer (``NORM_TYPES``) and any
    other parameter with fewer than 2 dimensions (custom RMSNorm scales, scalars). Embeddings and
    other weight matrices decay. Frozen parameters are left out; a shared (tied) parameter
    appears once, under the first name ``named_parameters()`` gives it. Within a group the order
    is ``named_parameters()`` order. Empty groups are omitted.

    With ``weight_decay == 0`` the split changes nothing, so there is a single group
    ``{"params": [...all, in named_parameters() order], "weight_decay": 0.0}`` (same dict shape).
    Note that switching weight_decay between 0 and non-zero changes the number of groups, so an
    optimizer state saved under one does not load under the other.
    """
    no_decay_ids: set[int] = set()
    for mod in module.modules():
        if isinstance(mod, NORM_TYPES):
            no_decay_ids.update(id(p) for p in mod.parameters(recurse=False))
    everything: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        everything.append(p)
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition keeps its full shape there
        if id(p) in no_decay_ids or ndim < 2 or NO_DECAY_NAMES.search(name.lower()):
            no_decay.append(p)
        else:
            decay.append(p)
    if weight_decay == 0.0:
        return [{"params": everything, "weight_decay": 0.0}] if everything else []
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _check_optimizer_settings(config: Any) -> None:
    """The ranges of the optimizer's fields (what applies to which class: ``lightlike.optimizers``)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(config.optimizer in OPTIMIZERS,
         f"optimizer={config.optimizer!r} is not valid; choose one of: {', '.join(OPTIMIZERS)}")
    need(config.weight_decay >= 0, f"weight_decay must be >= 0, got {config.weight_decay}")
    for name in ("adam_beta1", "adam_beta2"):
        v = getattr(config, name)
        need(0.0 <= v < 1.0, f"{name} must be in [0, 1), got {v}")
    need(config.adam_epsilon >= 0, f"adam_epsilon must be >= 0, got {config.adam_epsilon}")
    need(config.momentum >= 0, f"momentum must be >= 0, got {config.momentum}")
    family = LIBRARY_OPTIMIZERS[config.optimizer].family if config.optimizer in LIBRARY_OPTIMIZERS else None
    need(config.optimizer_target_modules is None or family == "galore",
         f"optimizer_target_modules={config.optimizer_target_modules!r} is for the GaLore optimizers (galore_adamw, "
         f"galore_adamw_8bit, galore_adafactor), not optimizer={config.optimizer!r}: drop it, or choose one of them")


def build_optimizer(module: nn.Module, config: Any, precision: Any = None,
                    total_steps: int | None = None) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` names (``lightlike.optimizers``: a ``torch.optim``
    class, or another library's), over ``param_groups(module, config.weight_decay)`` with
    ``lr=learning_rate``. GaLore's projected weights get a group of their own
    (``lightlike.optimizers.galore``); a schedule-free AdamW or SGD gets the warmup as its own
    ``warmup_steps`` (of ``total_steps``), as the HF Trainer passes it; LOMO is built on the module
    (``lightlike.optimizers.lomo``).

    The Adam family (``adamw``, ``adam``, ``nadam``, ``radam``) gets ``betas=(adam_beta1,
    adam_beta2), eps=adam_epsilon``; ``sgd`` and ``rmsprop`` get ``momentum``; every class then
    ``optimizer_kwargs``. ``fused=None`` passes ``fused=True`` to AdamW and Adam when every
    parameter is a floating tensor on a device with torch's fused kernel (CUDA, and the CPU since
    torch 2.4; call this after the module is on its device): one kernel per parameter instead of
    about ten element-wise ops (2.5x faster steps on a small CPU model, measured in
    benchmarks/RESULTS.md). ``fused=True`` is passed as is; ``False`` passes nothing. Weight
    decay in SGD, Adagrad, RMSprop and Adam is their coupled L2 term, AdamW's is decoupled.
    """
    _check_optimizer_settings(config)
    groups = param_groups(module, config.weight_decay)
    if not groups:
        raise ModuleContractError("the module has no trainable parameters (requires_grad=True) to optimize")
    params = [p for g in groups for p in g["params"]]
    check_device(config.optimizer, params[0].device)
    kwargs = optimizer_arguments(config, params)
    groups = _library_groups(module, config, groups, kwargs, total_steps)
    if config.optimizer in ("lomo", "adalomo"):
        from lightlike.optimizers.lomo import build_lomo

        return build_lomo(module, config, kwargs)
    if precision is not None and precision.param_dtype == torch.float16 and "betas" in kwargs \
            and kwargs.get("eps", 1.0) < torch.finfo(torch.float16).tiny:
        log.warning("adam_epsilon=%g underflows in float16 (16-true keeps optimizer state in fp16): "
                    "updates will be inf/NaN; set adam_epsilon=1e-4 or use precision='16-mixed'", kwargs["eps"])
    if kwargs.get("fused") and config.fused is None and "fused" not in config.optimizer_kwargs \
            and any(hasattr(p, "to_local") for p in params):
        # FSDP's ShardedGradScaler hands the fused kernel a found-inf flag of the wrong shape
        # for DTensor parameters (torch 2.13: "output with shape [] doesn't match the
        # broadcast shape [1]"): unfused under a precision with a grad scaler (the
        # strategy's: a strategy instance may bring its own while config.precision is "auto")
        if (precision if precision is not None else get_precision(config.precision)).uses_scaler:
            del kwargs["fused"]
    cls: Any = optimizer_class(config.optimizer)
    try:
        optimizer = cls(groups, lr=config.learning_rate, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:  # torch's checks of the values (a negative eps, ...)
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"{class_label(config.optimizer, cls)} refused lr="
                          f"{config.learning_rate!r}, {shown}: {e}", settings=("optimizer", "optimizer_kwargs")) from None
    if config.optimizer.startswith("galore_"):
        from lightlike.optimizers.galore import plain_projectors

        plain_projectors(optimizer)  # its state loads with weights_only=True
    return optimizer


def _library_groups(module: nn.Module, config: Any, groups: list[dict[str, Any]], kwargs: dict[str, Any],
                    total_steps: int | None) -> list[dict[str, Any]]:
    """GaLore's groups (its arguments taken out of ``kwargs``), and a schedule-free AdamW's or
    SGD's ``warmup_steps`` put in ``kwargs``; other optimizers' ``groups`` as they are."""
    entry = LIBRARY_OPTIMIZERS.get(config.optimizer)
    if entry is not None and entry.family == "galore":
        from lightlike.optimizers.galore import galore_groups, target_weights

        galore = {k: kwargs.pop(k, v) for k, v in GALORE_ARGUMENTS.items()}
        return galore_groups(groups, target_weights(module, config.optimizer_target_modules, config.optimizer), galore)
    if entry is not None and config.optimizer in SCHEDULE_FREE_WARMUP:
        warmup = total_warmup_steps(config, total_steps) if total_steps else int(config.warmup_steps)
        if "warmup_steps" in config.optimizer_kwargs and warmup:
            raise ConfigError(f"warmup is given twice: optimizer_kwargs['warmup_steps'] and warmup_steps/warmup_ratio "
                              f"({warmup} steps); set one of them", settings=("optimizer_kwargs", "warmup_steps"))
        kwargs.setdefault("warmup_steps", warmup)
    return groups


#: the schedule-free optimizers that warm up themselves (their ``warmup_steps``): the configured
#: warmup is theirs, and their learning-rate schedule has none (it would apply twice)
SCHEDULE_FREE_WARMUP = ("schedule_free_adamw", "schedule_free_sgd")


def build_optimizer_and_scheduler(module: Any, config: Any, precision: Any,
                                  total_steps: int) -> tuple[Any, Any]:
    """The optimizer and scheduler of an automatic module: ``configure_optimizers``' or the
    built-in ones. An optimizer without a scheduler (from ``configure_optimizers`` too) gets the
    configured schedule (``lr_scheduler``, warmup), as the HF Trainer gives it; schedulers from
    ``configure_optimizers`` are stepped as Lightning steps them (``lightlike.lr_schedulers``)."""
    custom = call_configure_optimizers(module, config)
    scheduler: Any = None
    if custom is not None:
        optimizer, configs = lr_schedulers.read_configure_optimizers(custom)
        lr_schedulers.check_at_set_up(configs, config)
        scheduler = lr_schedulers.Schedulers(optimizer, configs) if configs else None
    else:
        optimizer = build_optimizer(module, config, precision, total_steps)
        if config.optimizer in SCHEDULE_FREE_WARMUP:
            config = config.replace(warmup_steps=0, warmup_ratio=0.0)
    if scheduler is None:
        scheduler = build_scheduler(optimizer, config, total_steps)
    return optimizer, scheduler


# -- schedules -------------------------------------------------------------------------------------
def total_warmup_steps(config: Any, total_steps: int) -> int:
    """``warmup_steps`` if > 0, else ``ceil(warmup_ratio * total_steps)``. The product is rounded
    to 9 decimals first, so float noise does not add a step (0.07 * 100 is 7, not 8; HF's own
    ``ceil`` would give 8)."""
    if config.warmup_steps > 0:
        return int(config.warmup_steps)
    return math.ceil(round(config.warmup_ratio * total_steps, 9))


def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(warmup: int, total: int, step: int) -> float:
    """HF's linear schedule; (warmup, total) come first so that the scheduler's call, every step,
    goes through a positional ``partial`` (keywords cost it a dict per call), and the two
    ``max`` of HF's formula are written as conditions (a builtin call each)."""
    if step < warmup:
        return _warmup(step, warmup)
    span = total - warmup
    left = float(total - step) / float(span if span > 1 else 1)
    return left if left > 0.0 else 0.0


def _cosine(step: int, warmup: int, total: int, cycles: float) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))


def _cosine_restarts(step: int, warmup: int, total: int, cycles: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(cycles) * progress) % 1.0))))


def _polynomial(step: int, warmup: int, total: int, lr_init: float, lr_end: float, power: float) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / lr_init
    remaining = 1.0 - (step - warmup) / max(1, total - warmup)  # HF divides by 0 when total == warmup
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, total_steps: int) -> Any:
    """``LambdaLR`` for ``config.lr_scheduler`` over ``total_steps`` optimizer steps, with the
    formulas of HF transformers' ``get_*_schedule_with_warmup``:

    - ``linear``: warmup, then linear decay to 0 at ``total_steps``.
    - ``cosine``: warmup, then ``0.5 * (1 + cos(pi * 2 * num_cycles * progress))`` (0.5 = half wave).
    - ``cosine_with_restarts``: ``num_cycles`` counts hard restarts: ``max(1, int(num_cycles))``,
      so the default 0.5 means 1 (HF's default) and 2.7 means 2.
    - ``polynomial``: ``(lr - lr_end) * (1 - progress) ** power + lr_end``, with ``lr`` the
      optimizer's default lr (= ``learning_rate`` for the built-in optimizers); needs lr_end < lr.
    - ``constant``: 1 always; with warmup set it raises (use ``constant_with_warmup``).
    - ``constant_with_warmup``: warmup, then 1.
    - ``cosine_with_min_lr``, ``wsd``, ``inverse_sqrt``, ``reduce_lr_on_plateau``: with
      ``lr_scheduler_kwargs`` of their own (``lightlike.schedules``).
    """
    name = config.lr_scheduler
    schedules.check_schedule_kwargs(name, config.lr_scheduler_kwargs)
    if not (isinstance(total_steps, int) and total_steps > 0):
        raise ConfigError(f"build_scheduler needs total_steps > 0 optimizer steps, got {total_steps!r}")
    warmup = total_warmup_steps(config, total_steps)
    if warmup >= total_steps and name != "constant":
        log.warning("warmup_steps=%d is not below this run's %d optimizer steps: the learning rate never reaches "
                    "learning_rate=%g (the warmup ends after the last step); lower warmup_steps, or train longer",
                    warmup, total_steps, config.learning_rate)
    fn: Callable[[int], float]
    if name == "constant":
        if warmup:
            raise ConfigError(f"lr_scheduler='constant' has no warmup (got {warmup} warmup steps): "
                              "use lr_scheduler='constant_with_warmup', or set warmup_steps=0 and warmup_ratio=0")
        fn = _constant
    elif name == "constant_with_warmup":
        fn = functools.partial(_constant_with_warmup, warmup=warmup)
    elif name == "linear":
        fn = functools.partial(_linear, warmup, total_steps)
    elif name == "cosine":
        if not config.num_cycles > 0:
            raise ConfigError(f"lr_scheduler='cosine' needs num_cycles > 0, got {config.num_cycles}")
        fn = functools.partial(_cosine, warmup=warmup, total=total_steps, cycles=float(config.num_cycles))
    elif name == "cosine_with_restarts":
        fn = functools.partial(_cosine_restarts, warmup=warmup, total=total_steps,
                               cycles=max(1, int(config.num_cycles)))
    elif name == "polynomial":
        lr_init = float(optimizer.defaults["lr"])
        if not 0.0 <= config.lr_end < lr_init:
            raise ConfigError(f"lr_scheduler='polynomial' needs 0 <= lr_end ({config.lr_end}) < "
                              f"learning_rate ({lr_init})")
        if not config.power > 0:  # a negative power climbs above the peak rate and divides by zero at the end
            raise ConfigError(f"lr_scheduler='polynomial' needs power > 0, got {config.power}")
        fn = functools.partial(_polynomial, warmup=warmup, total=total_steps, lr_init=lr_init,
                               lr_end=float(config.lr_end), power=float(config.power))
    elif name in schedules.NAMES:  # the ones with lr_scheduler_kwargs of their own
        return schedules.build_schedule(optimizer, config, total_steps, warmup)
    else:
        raise ConfigError(f"lr_scheduler={name!r} is not valid; choose one of: {', '.join(SCHEDULERS)}")
    return LambdaLR(optimizer, fn)


# -- TaskModule.configure_optimizers ---------------------------------------------------------------
_ACCEPTED = ("return an Optimizer, (optimizer, scheduler), or {'optimizer': ..., 'lr_scheduler': ...} "
             "(scheduler may be None, or Lightning's {'scheduler': s, 'interval': 'step'}; in manual optimization it "
             "steps at each ctx.step; Lightning's [optimizer] and ([optimizer], [scheduler]) are read too)")
_SCHEDULER_METHODS = ("step", "get_last_lr", "state_dict", "load_state_dict")


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    if scheduler is None:
        return None
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ModuleContractError("configure_optimizers returned ReduceLROnPlateau, which needs a metric at "
                                  "each step; the Fitter steps schedulers once per optimizer step with no "
                                  "argument: use a step-based scheduler (e.g. LambdaLR), or drop it and set "
                                  "lr_scheduler='reduce_lr_on_plateau' (stepped after each evaluation)")
    missing = [m for m in _SCHEDULER_METHODS if not callable(getattr(scheduler, m, None))]
    if missing:
        raise ModuleContractError(f"configure_optimizers returned a scheduler of type {type(scheduler).__name__} "
                                  f"without {', '.join(m + '()' for m in missing)}; {_ACCEPTED}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ModuleContractError("configure_optimizers returned a scheduler built on a different optimizer "
                                  "than the one it returned")
    return scheduler


def call_configure_optimizers(module: Any, config: Any) -> Any:
    """``module.configure_optimizers(config)``; a Lightning-style ``configure_optimizers(self)``
    (no argument) is called without the config."""
    try:
        takes_config = bool(inspect.signature(module.configure_optimizers).parameters)
    except (TypeError, ValueError):  # no signature to read: call it the documented way
        takes_config = True
    if takes_config:
        return module.configure_optimizers(config)
    result = module.configure_optimizers()
    if result is not None:  # None: the built-in ones, which read them
        defaults = field_defaults(type(config))
        try:  # an automatic module's optimizer without a scheduler gets the configured schedule
            read = () if lr_schedulers.read_configure_optimizers(result)[1] else SCHEDULE_FIELDS
        except ModuleContractError:  # several optimizers (manual optimization)
            read = ()
        unread = [f"{name}={getattr(config, name)!r}" for name in OPTIMIZER_FIELDS
                  if getattr(config, name) != defaults[name] and name not in read]
        if unread:
            log.warning("%s.configure_optimizers() takes no config, so %s set for this fit %s not used: its "
                        "optimizer and scheduler are. Give it a config parameter to read them, or drop them",
                        type(module).__name__, ", ".join(unread), "is" if len(unread) == 1 else "are")
    return result


#: the fields the configured schedule reads (also for an optimizer from configure_optimizers)
SCHEDULE_FIELDS = ("lr_scheduler", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "num_cycles", "lr_end",
                   "power")
#: the fields only the built-in optimizer and scheduler read
OPTIMIZER_FIELDS = ("optimizer", "optimizer_kwargs", "optimizer_target_modules", "learning_rate", "weight_decay",
                    "adam_beta1", "adam_beta2", "adam_epsilon", "momentum", "fused", "lr_scheduler", "lr_scheduler_kwargs", "warmup_steps",
                    "warmup_ratio", "num_cycles", "lr_end", "power")


def unwrap_configure_optimizers(result: Any) -> tuple[torch.optim.Optimizer, Any]:
    """Normalise one entry of what a manual module's ``configure_optimizers`` returned to
    ``(optimizer, scheduler or None)``; the scheduler steps at each ``ctx.step`` of its optimizer
    (an automatic module's are read by ``lightlike.lr_schedulers.read_configure_optimizers``).

    Accepted: an ``Optimizer``; a 2-tuple/list ``(optimizer, scheduler)``; a mapping with key
    ``"optimizer"`` and optionally ``"lr_scheduler"``. A scheduler needs ``step()``,
    ``get_last_lr()``, ``state_dict()`` and ``load_state_dict()`` and must drive that optimizer.
    Anything else raises ``ModuleContractError``.
    """
    if isinstance(result, torch.optim.Optimizer):
        return result, None
    if isinstance(result, (tuple, list)) and len(result) == 1:  # Lightning's [optimizer] / [{...}]
        return unwrap_configure_optimizers(result[0])
    if isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(x, (tuple, list)) for x in result) \
            and len(result[0]) == 1 and len(result[1]) <= 1:  # Lightning's ([optimizer], [scheduler] or [])
        result = (result[0][0], result[1][0] if result[1] else None)
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.optim.Optimizer):
        return result[0], _check_scheduler(_lightning_scheduler(result[1]), result[0])
    if isinstance(result, Mapping) and isinstance(result.get("optimizer"), torch.optim.Optimizer):
        unknown = sorted(str(k) for k in result if k not in ("optimizer", "lr_scheduler"))
        if unknown:
            raise ModuleContractError(f"configure_optimizers returned a dict with unknown key(s) {unknown}; "
                                      "only 'optimizer' and 'lr_scheduler' are read")
        scheduler = _lightning_scheduler(result.get("lr_scheduler"))
        return result["optimizer"], _check_scheduler(scheduler, result["optimizer"])
    raise ModuleContractError(f"configure_optimizers returned {_describe(result)}; {_ACCEPTED}")


def _lightning_scheduler(entry: Any) -> Any:
    """Lightning's scheduler dict ``{'scheduler': s, 'interval': 'step', 'frequency': 1}`` in
    manual optimization: the scheduler, when it is stepped as ``ctx.step`` steps it."""
    if not isinstance(entry, Mapping):
        return entry
    unknown = sorted(str(k) for k in entry if k not in ("scheduler", "interval", "frequency", "name", "monitor",
                                                          "strict"))
    interval, frequency = entry.get("interval", "epoch"), entry.get("frequency", 1)
    if "scheduler" not in entry or unknown:
        raise ModuleContractError(f"configure_optimizers returned a scheduler dict with keys {sorted(map(str, entry))}; "
                                  "give {'scheduler': s, 'interval': 'step'} or the scheduler itself")
    if interval != "step" or frequency != 1:
        raise ModuleContractError(
            f"configure_optimizers returned a scheduler with interval={interval!r}, frequency={frequency!r} "
            "(Lightning's default interval is 'epoch'); in manual optimization a scheduler steps at each ctx.step "
            "of its optimizer: give 'interval': 'step' and 'frequency': 1, with the schedule in optimizer steps")
    return entry["scheduler"]


def _describe(result: Any) -> str:
    if isinstance(result, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in result[:4]) + (", ..." if len(result) > 4 else "")
        return f"a {type(result).__name__} of {len(result)} ({inner})"
    if isinstance(result, Mapping):
        return f"a dict with keys {sorted(str(k) for k in result)} and no Optimizer under 'optimizer'"
    return f"a {type(result).__name__}"

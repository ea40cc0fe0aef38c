"""Built-in optimizers and learning-rate schedules (the HF Trainer's formulas).

Schedules are ``LambdaLR`` over module-level functions bound with ``functools.partial``, stepped
once per applied optimizer step; ``scheduler.get_last_lr()`` after ``k`` steps is
``learning_rate * factor(k)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightlike.errors import ConfigError, ModuleContractError

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights that decay, and biases / normalisation weights / other 1-D
    parameters that never do. Shared (tied) parameters appear once; empty groups are left out.
    With ``weight_decay == 0`` the two would be identical, so there is one group."""
    no_decay_ids: set[int] = set()
    for mod in module.modules():
        if isinstance(mod, NORM_TYPES):
            no_decay_ids.update(id(p) for p in mod.parameters(recurse=False))
    decay, no_decay, seen = [], [], set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in no_decay_ids or p.ndim < 2 or name.endswith("bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    if weight_decay == 0.0:  # one group does the same work with one optimizer kernel call, not two
        return [{"params": decay + no_decay, "weight_decay": 0.0}] if decay or no_decay else []
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(module: nn.Module, config: Any) -> torch.optim.Optimizer:
    groups = param_groups(module, config.weight_decay)
    if not groups:
        raise ModuleContractError("the module has no trainable parameters (requires_grad=True) to optimize")
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.learning_rate, momentum=config.momentum)
    kwargs: dict[str, Any] = {}
    fused = config.fused
    if fused is None:
        fused = all(p.is_cuda for g in groups for p in g["params"]) or None
    if fused:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_epsilon, **kwargs)


def total_warmup_steps(config: Any, total_steps: int) -> int:
    if config.warmup_steps > 0:
        return int(config.warmup_steps)
    return math.ceil(config.warmup_ratio * total_steps)


# -- schedule factors (module-level so partials pickle) ---------------------------------------------
def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


def _linear(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, warmup: int, total: int, cycles: float) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))


def _cosine_restarts(step: int, warmup: int, total: int, cycles: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0))))


def _polynomial(step: int, warmup: int, total: int, lr_init: float, lr_end: float, power: float) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if step > total:
        return lr_end / lr_init
    decay_steps = total - warmup
    remaining = 1 - (step - warmup) / max(1, decay_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    name = config.lr_scheduler
    warmup = total_warmup_steps(config, total_steps)
    if name == "constant":
        if warmup:
            raise ConfigError("lr_scheduler='constant' has no warmup; use 'constant_with_warmup' or drop warmup")
        fn: Any = _constant
    elif name == "constant_with_warmup":
        fn = functools.partial(_constant_with_warmup, warmup=warmup)
    elif name == "linear":
        fn = functools.partial(_linear, warmup=warmup, total=total_steps)
    elif name == "cosine":
        fn = functools.partial(_cosine, warmup=warmup, total=total_steps, cycles=float(config.num_cycles))
    elif name == "cosine_with_restarts":
        # num_cycles counts hard restarts here (HF default 1); below 1 means 1
        fn = functools.partial(_cosine_restarts, warmup=warmup, total=total_steps,
                               cycles=max(1, int(config.num_cycles)))
    elif name == "polynomial":
        if not config.lr_end < config.learning_rate:
            raise ConfigError(f"lr_scheduler='polynomial' needs lr_end ({config.lr_end}) < "
                              f"learning_rate ({config.learning_rate})")
        fn = functools.partial(_polynomial, warmup=warmup, total=total_steps, lr_init=config.learning_rate,
                               lr_end=config.lr_end, power=config.power)
    else:
        raise ConfigError(f"unknown lr_scheduler {name!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def unwrap_configure_optimizers(result: Any) -> tuple[torch.optim.Optimizer, Any]:
    """Accept an optimizer, ``(optimizer, scheduler)`` or ``{"optimizer", "lr_scheduler"}``."""
    if isinstance(result, torch.optim.Optimizer):
        return result, None
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.optim.Optimizer):
        return result[0], result[1]
    if isinstance(result, Mapping) and isinstance(result.get("optimizer"), torch.optim.Optimizer):
        return result["optimizer"], result.get("lr_scheduler")
    raise ModuleContractError(
        f"configure_optimizers returned {type(result).__name__}; return an Optimizer, "
        "(optimizer, scheduler), or {'optimizer': ..., 'lr_scheduler': ...}"
    )

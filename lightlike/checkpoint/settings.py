"""``config.json``: the run's ``FitConfig``, and what a resume with changed settings does.

``RunSettings`` is the registry's ``config`` entry. At a resume it owns the policy for settings
changed since the checkpoint: an optimizer that cannot take the checkpoint's state is refused
before anything is restored (``check_optimizer_fits``), and changed optimizer settings
(``learning_rate``, ``weight_decay``, AdamW's betas and epsilon, SGD's momentum, ...) are
applied to the restored optimizer and schedule, which would otherwise bring back the old values,
with one warning listing every changed setting (``apply_changed_settings``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightlike.errors import ConfigError
from lightlike.module import TaskModule

if TYPE_CHECKING:
    from lightlike.config import FitConfig

log = logging.getLogger("lightlike")

#: Settings whose change between runs makes a resumed run no longer a pure continuation.
CONTINUATION_KEYS = ("batch_size", "grad_accum_steps", "learning_rate", "max_steps", "max_epochs", "seed",
                     "lr_scheduler", "warmup_steps", "warmup_ratio", "weight_decay", "optimizer", "precision",
                     "shuffle", "drop_last", "adam_beta1", "adam_beta2", "adam_epsilon", "momentum",
                     "max_grad_norm", "max_grad_value", "lr_end", "power", "num_cycles", "fused", "optimizer_kwargs",
                     "lr_scheduler_kwargs")
#: Optimizer settings the restored optimizer/scheduler state holds: a change is applied after loading
#: it (built-in optimizers only; a module's own ``configure_optimizers`` keeps the restored values).
APPLIED_KEYS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "momentum", "fused",
                "optimizer_kwargs")
#: Settings that shape the schedule: the rebuilt scheduler has them, the restored group lr not yet
SCHEDULE_KEYS = ("max_steps", "max_epochs", "batch_size", "grad_accum_steps", "lr_scheduler", "warmup_steps",
                 "warmup_ratio", "lr_end", "power", "num_cycles", "lr_scheduler_kwargs")


class RunSettings:
    """The ``config`` entry: ``config.json`` holds this run's ``FitConfig``; a resume keeps this
    run's settings and reads the checkpoint's only to compare them (``saved``)."""

    def __init__(self, config: FitConfig, module: Any, optimizer: Any, scheduler: Any,
                 data_order: Callable[[], Any]):
        self.config, self.module, self.optimizer, self.scheduler = config, module, optimizer, scheduler
        self.data_order = data_order  # this run's (the loop's order_key)
        self.saved: dict[str, Any] | None = None  # the checkpoint's settings, once loaded

    def state_dict(self) -> dict[str, Any]:
        return self.config.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state

    def check_resume(self, loading: Any) -> None:
        """A built-in optimizer that cannot take the checkpoint's optimizer state is refused."""
        check_optimizer_fits(self.module, self.config, loading.saved.get("config"), loading.path)

    def after_load(self, loading: Any) -> None:
        """Changed optimizer settings applied to the restored state, and one warning naming every
        changed setting (and the data order's, from the checkpoint's ``trainer_state``)."""
        saved_order = (loading.saved.get("trainer_state") or {}).get("data_order")
        apply_changed_settings(self.config, self.module, self.optimizer, self.scheduler, self.saved,
                               (saved_order, self.data_order()))


def check_optimizer_fits(module: Any, now: FitConfig, old: dict[str, Any] | None, path: Path) -> None:
    """Before the optimizer state of ``path`` (saved with the settings ``old``) is loaded: a
    built-in optimizer of another kind, or with weight decay switched on or off (one parameter
    group without it, two with), cannot take it (torch would load it and fail at the first step,
    or refuse it without saying why)."""
    if getattr(type(module), "configure_optimizers", None) is not TaskModule.configure_optimizers:
        return  # the module's own optimizer: its shape is the module's business
    if old is None:
        return
    fix = (f"resume with the checkpoint's setting, or start a new fit from its weights (module.load_weights('{path}') "
           "before fit, without resume)")
    if old.get("optimizer", now.optimizer) != now.optimizer:
        raise ConfigError(f"optimizer changed from {old['optimizer']!r} to {now.optimizer!r} since {path.name}: "
                          f"its optimizer state cannot drive the new optimizer; {fix}")
    before = float(old.get("weight_decay", now.weight_decay))
    if (before == 0.0) != (now.weight_decay == 0.0):
        raise ConfigError(f"weight_decay changed from {before} to {now.weight_decay} since {path.name}: switching "
                          "decay on or off changes the optimizer's parameter groups (one without decay, two "
                          f"with), so its state cannot be restored; {fix}")


def apply_changed_settings(config: FitConfig, module: Any, optimizer: Any, scheduler: Any,
                           old: dict[str, Any] | None, data_order: tuple[Any, Any] = (None, None)) -> None:
    """After the optimizer and scheduler state are loaded from a checkpoint saved with the
    settings ``old``: apply changed optimizer settings to them (built-in optimizers) and warn,
    listing every changed setting (and what of ``data_order``, the saved and this run's, differs)."""
    if old is None:
        return
    now = config.to_dict()
    changed = [k for k in CONTINUATION_KEYS if k in old and old.get(k) != now.get(k)]
    order = _changed_order(*data_order, changed)
    if not changed and not order:
        return
    listing = "; ".join([f"{k}: {old.get(k)!r} -> {now.get(k)!r}" for k in changed] + order)
    log.warning("resuming with changed settings (%s): the run is no longer a pure continuation", listing)
    applied = [k for k in changed if k in APPLIED_KEYS or k in SCHEDULE_KEYS]
    if not applied:
        return

    if module is not None and type(module).configure_optimizers is not TaskModule.configure_optimizers:
        log.warning("%s changed, but the optimizer comes from %s.configure_optimizers: the restored optimizer "
                    "and scheduler state wins (set the new values there, after loading, if you want them)",
                    ", ".join(applied), type(module).__name__)
        return
    _apply(config, optimizer, scheduler, {k: old[k] for k in applied}, {k: now[k] for k in applied},
           schedule_changed=any(k in SCHEDULE_KEYS for k in applied))
    log.info("applied the new %s to the restored optimizer and schedule", ", ".join(applied))


def _changed_order(saved: Any, order: Any, changed: list[str]) -> list[str]:
    """What else the data order depends on that changed since the checkpoint (``saved``, its
    ``data_order``; ``order``, this run's), as ``"data order's key: old -> new"`` (keys ``changed``
    already names left out, and keys an older checkpoint did not record): at an epoch's end the next epochs' order changes with it (an
    IterableDataset's with num_workers, dealt over the workers; mid-epoch such a change is
    refused before this is called)."""
    if not isinstance(saved, dict) or not isinstance(order, dict):
        return []
    return [f"data order's {k}: {saved.get(k)!r} -> {order.get(k)!r}" for k in sorted(saved, key=str)
            if k not in changed and saved.get(k) != order.get(k)]


def _apply(config: FitConfig, optimizer: Any, sched: Any, old: dict[str, Any], new: dict[str, Any],
           schedule_changed: bool = False) -> None:
    optimizer = sched.optimizer if sched is not None and hasattr(sched, "optimizer") else optimizer
    assert optimizer is not None
    groups = optimizer.param_groups
    if "learning_rate" in new or (schedule_changed and sched is not None):
        # the next step's rate from the new schedule at the restored position (LambdaLR.get_lr)
        lr = float(new.get("learning_rate", config.learning_rate))
        for g in groups:
            if "initial_lr" in g:
                g["initial_lr"] = lr
        lambdas = getattr(sched, "lr_lambdas", None)
        if sched is not None and hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr for _ in sched.base_lrs]
        if lambdas is not None and len(lambdas) == len(groups):  # LambdaLR (the built-in schedules)
            # the rate of the next step: what the schedule gives at its position (LambdaLR.get_lr)
            lrs = [lr * fn(sched.last_epoch) for fn in lambdas]
        elif "learning_rate" in new:
            before = float(old["learning_rate"])
            lrs = [float(g["lr"]) * lr / before if before else lr for g in groups]
        else:
            lrs = [float(g["lr"]) for g in groups]
        for g, value in zip(groups, lrs, strict=True):
            g["lr"] = value
        if sched is not None and hasattr(sched, "_last_lr"):
            sched._last_lr = [g["lr"] for g in groups]
    if "weight_decay" in new:
        for g in groups:
            if g.get("weight_decay"):  # only the groups that decay (never biases and norms)
                g["weight_decay"] = float(new["weight_decay"])
    for g in groups:
        if "betas" in g and ("adam_beta1" in new or "adam_beta2" in new):
            b1, b2 = g["betas"]
            g["betas"] = (float(new.get("adam_beta1", b1)), float(new.get("adam_beta2", b2)))
        if "eps" in g and "adam_epsilon" in new:
            g["eps"] = float(new["adam_epsilon"])
        if "momentum" in g and "momentum" in new:
            g["momentum"] = float(new["momentum"])
    if "optimizer_kwargs" in new:  # the new arguments (or, for one dropped, the class's default) in every group
        for key in {*old["optimizer_kwargs"], *new["optimizer_kwargs"]} & set(getattr(optimizer, "defaults", {})):
            for g in groups:
                g[key] = optimizer.defaults[key]
    if "fused" in new:
        _apply_fused(optimizer)


def _apply_fused(optimizer: Any) -> None:
    """The kernel the optimizer was built with (``fused``: its ``defaults``, resolved from the new
    setting) for every group, which the restored state replaced with the checkpoint's; each
    ``step`` counter goes where that kernel keeps it (fused: on the parameter's device, float32;
    else on the host), as torch's ``load_state_dict`` places it for the group's kernel."""
    defaults = getattr(optimizer, "defaults", None)
    if not isinstance(defaults, dict) or "fused" not in defaults:  # (a wrapper's: not torch's choice to make)
        return
    fused = defaults["fused"]
    for g in optimizer.param_groups:
        if "fused" not in g or bool(g["fused"]) == bool(fused):
            continue
        g["fused"] = fused
        for p in g["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                on = p.device if fused or g.get("capturable") else torch.device("cpu")
                optimizer.state[p]["step"] = step.to(dtype=torch.float32, device=on)

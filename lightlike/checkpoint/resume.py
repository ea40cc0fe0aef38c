"""Choosing the checkpoint to resume from, and what a resume changes around it.

- ``resolve_resume``: ``resume=True`` (the newest valid checkpoint, or an error), ``"auto"`` (the
  newest valid one, or a fresh start), or a path.
- ``tidy_output_dir``: on the main rank, after the checkpoint is loaded: removes temp and trash
  directories left by killed saves, and moves checkpoints newer than the one resumed from (an
  abandoned continuation, after a rollback to an older one) into ``output_dir/abandoned-<time>/``
  with a warning, so that neither rotation nor a later ``resume=True`` mixes them with this run.
- ``apply_changed_settings``: optimizer settings changed between runs (``learning_rate``,
  ``weight_decay``, AdamW's betas and epsilon, SGD's momentum) are applied to the restored
  optimizer and schedule state, which would otherwise bring back the old values.
- ``best_checkpoint_name`` / ``resolve_best``: the best checkpoint is stored by its directory name
  and found again in the current ``output_dir``.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightlike.best import greater_is_better, is_improvement, key_candidates
from lightlike.checkpoint.atomic import cleanup_stale_temps, move_into_new_dir
from lightlike.checkpoint.lock import LOCK_NAME
from lightlike.checkpoint.manifest import CHECKPOINT_DIR_NAME, MANIFEST, checkpoint_step, find_latest_valid
from lightlike.errors import CheckpointError, ConfigError
from lightlike.module import TaskModule

if TYPE_CHECKING:
    from lightlike.config import FitConfig
    from lightlike.state import FitState

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
#: Prefix of the directory that receives checkpoints of an abandoned continuation.
ABANDONED = "abandoned-"


def resolve_resume(config: FitConfig, resume: bool | str) -> Path | None:
    """``True``: the newest valid checkpoint in output_dir (an error if there is none);
    ``"auto"``: the same, or None (start fresh) if there is none; a path: that checkpoint."""
    if resume is True or resume == "auto":
        found = find_latest_valid(config.output_dir, hashes=config.verify_hashes, resumable=True)
        if found is not None:
            return Path(found)
        if resume == "auto":
            log.info("resume='auto': %r holds no valid checkpoint; starting a fresh run", config.output_dir)
            return None
        out = Path(config.output_dir)
        # logs of a run killed before its first save, say (the lock file is this run's own)
        left = out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir())
        fresh = ("pass resume='auto' to move what is there aside and start afresh" if left else
                 "start without resume, pass resume='auto' (resume if there is a checkpoint, else start fresh)")
        raise CheckpointError(
            f"resume=True but {config.output_dir!r} holds no valid checkpoint to resume from (weights-only "
            f"ones, from save_only_model, cannot resume a run); {fresh}, or pass resume='path/to/checkpoint-N'",
            offers=("resume='auto'",),
        )
    p = Path(str(resume))
    if not p.is_dir():
        raise CheckpointError(f"resume={str(resume)!r}: no such checkpoint directory")
    if not (p / MANIFEST).exists() and any(CHECKPOINT_DIR_NAME.match(c.name) for c in p.iterdir() if c.is_dir()):
        raise CheckpointError(f"resume={str(resume)!r} is a run's output_dir, not one checkpoint: pass resume=True "
                              f"(its newest valid checkpoint; --resume on the command line) or '{p}/checkpoint-N'")
    return p


# -- output_dir around a resume ------------------------------------------------------------------
def tidy_output_dir(output_dir: str | Path, resumed_step: int | None = None, source: str | Path | None = None) -> Path | None:
    """Main rank only, with no save in flight: remove temp/trash directories of killed saves and,
    when ``resumed_step`` is given, move ``checkpoint-N`` directories with ``N > resumed_step``
    aside (``set_aside_newer``). Returns the directory they went to, if any."""
    for p in cleanup_stale_temps(output_dir):
        log.info("removed %s, left by an interrupted checkpoint save", p)
    if resumed_step is None:
        return None
    return set_aside_newer(output_dir, resumed_step, source)


def set_aside_newer(output_dir: str | Path, step: int, source: str | Path | None = None) -> Path | None:
    """Move every ``checkpoint-N`` directory of ``output_dir`` with ``N > step`` (valid or not) into
    a new ``output_dir/abandoned-<UTC time>/``, with a copy of ``logs/``, and warn naming them. A
    run resumed from an older checkpoint would otherwise count them as its newest (rotation then
    deletes what it saves, ``resume=True`` later picks them). Returns the new directory or None."""
    out = Path(output_dir)
    if not out.is_dir():
        return None
    newer = sorted((p for p in out.iterdir() if p.is_dir() and (m := CHECKPOINT_DIR_NAME.match(p.name)) and int(m.group(1)) > step),
                   key=checkpoint_step)
    if not newer:
        return None
    dest = set_aside(out, newer)
    if (out / "logs").is_dir():  # the loggers are about to drop what was logged after `step`
        shutil.copytree(out / "logs", dest / "logs")
    src = f" {Path(source).name}" if source is not None else f" the checkpoint of step {step}"
    msg = (f"resumed from{src}, older than {', '.join(p.name for p in newer)} in {out}: moved those "
           f"into {dest} (with a copy of logs/) so that this run does not mix with the one it replaces")
    log.warning(msg)
    warnings.warn(msg, stacklevel=2)
    return dest


def set_aside(output_dir: str | Path, paths: list[Path]) -> Path:
    """Move ``paths`` (entries of ``output_dir``) into a new ``output_dir/abandoned-<UTC time>/``,
    which ``list_checkpoints``, rotation and ``resume=True`` never look into. Returns it."""
    return move_into_new_dir(output_dir, paths, ABANDONED)


# -- the best checkpoint -------------------------------------------------------------------------
def best_checkpoint_name(stored: str | None) -> str | None:
    """What ``trainer_state.json`` stores: the directory name (``checkpoint-N``), valid from any
    working directory and after the run directory is moved."""
    return Path(stored).name if stored else None


def resolve_best(output_dir: str | Path, stored: str | None, best_step: int | None) -> str | None:
    """The best checkpoint's path in the current ``output_dir`` from what a checkpoint stored (its
    name) or the fit's state holds (its path). None unless it names the checkpoint saved at ``best_step`` and that checkpoint
    is still there (committed: it has a manifest), with a warning when it is gone."""
    if not stored:
        return None
    m = CHECKPOINT_DIR_NAME.match(Path(stored).name)
    if m is None or best_step is None or int(m.group(1)) != best_step:
        return None
    path = Path(output_dir) / Path(stored).name
    if not (path / MANIFEST).is_file():
        log.warning("the best checkpoint so far (%s) is no longer in %s: load_best_at_end will keep the final "
                    "weights unless a later evaluation is better", path.name, output_dir)
        return None
    return str(path)


def saved_config(path: Path) -> dict[str, Any] | None:
    """The FitConfig a checkpoint was saved with (its ``config.json``), or None if unreadable."""
    try:
        return json.loads((path / "config.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def choose_best_again(cfg: FitConfig, state: FitState, path: Path) -> None:
    """``metric_for_best`` or its direction changed since ``path`` was saved: the restored best
    (a value of the old metric, or the old direction's best) would be compared with the new
    metric's values. The best so far is chosen again from the evaluations in the log history
    under this run's setting; its checkpoint is the one saved at that step, if it is still there."""
    old = saved_config(path)
    if old is None:
        return
    old_key, key = old.get("metric_for_best"), cfg.metric_for_best
    old_way = greater_is_better(old_key, old.get("greater_is_better")) if old_key else None
    way = greater_is_better(key, cfg.greater_is_better) if key else None
    if (old_key, old_way) == (key, way):
        return
    state.best_metric = state.best_step = state.best_checkpoint = None
    if key is not None:
        for row in state.log_history:
            # a set-less key ("accuracy"): the one evaluation metric it names (training rows' keys are train/...)
            found = key_candidates(key, (k for k in row if k != "step" and not k.startswith("train/")))
            if len(found) == 1 and is_improvement(row[found[0]], state.best_metric, bool(way)):
                state.best_metric, state.best_step = row[found[0]], int(row["step"])
        if state.best_step is not None:
            state.best_checkpoint = resolve_best(cfg.output_dir, f"checkpoint-{state.best_step}", state.best_step)
    if key is None:
        found = "none is tracked"
    elif state.best_step is None:
        found = "no evaluation logged so far has it"
    else:
        kept = Path(state.best_checkpoint).name if state.best_checkpoint else "none kept at that step"
        found = f"step {state.best_step} ({key}={state.best_metric:.6g}, checkpoint: {kept})"
    log.warning("metric_for_best changed since %s: %s -> %s; the best so far is chosen again from the logged "
                "evaluations: %s. Checkpoints the earlier run kept or rotated by its own best stay as they are",
                path.name, _direction(old_key, old_way), _direction(key, way), found)


def _direction(key: str | None, greater: bool | None) -> str:
    return "none" if key is None else f"{key} ({'higher' if greater else 'lower'} is better)"


# -- settings changed between runs ---------------------------------------------------------------
def check_optimizer_fits(module: Any, now: FitConfig, path: Path) -> None:
    """Before the optimizer state of ``path`` is loaded: a built-in optimizer of another kind, or
    with weight decay switched on or off (one parameter group without it, two with), cannot take
    it (torch would load it and fail at the first step, or refuse it without saying why)."""
    if getattr(type(module), "configure_optimizers", None) is not TaskModule.configure_optimizers:
        return  # the module's own optimizer: its shape is the module's business
    old = saved_config(path)
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


def apply_changed_settings(config: FitConfig, module: Any, optimizer: Any, scheduler: Any, path: Path,
                           data_order: tuple[Any, Any] = (None, None)) -> None:
    """After the optimizer and scheduler state are loaded from ``path``: apply changed optimizer
    settings to them (built-in optimizers) and warn, listing every changed setting (and what of
    ``data_order``, the saved and this run's, differs)."""
    old = saved_config(path)
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
    already names left out): at an epoch's end the next epochs' order changes with it (an
    IterableDataset's with num_workers, dealt over the workers; mid-epoch such a change is
    refused before this is called)."""
    if not isinstance(saved, dict) or not isinstance(order, dict):
        return []
    return [f"data order's {k}: {saved.get(k)!r} -> {order.get(k)!r}" for k in sorted({*saved, *order}, key=str)
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


__all__ = ["apply_changed_settings", "best_checkpoint_name", "resolve_best", "resolve_resume", "set_aside",
           "set_aside_newer", "tidy_output_dir"]

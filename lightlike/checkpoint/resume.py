"""Choosing the checkpoint to resume from, and the output directory around a resume.

- ``resolve_resume``: ``resume=True`` (the newest valid checkpoint, or an error), ``"auto"`` (the
  newest valid one, or a fresh start), or a path.
- ``tidy_output_dir``: on the main rank, after the checkpoint is loaded: removes temp and trash
  directories left by killed saves, and moves checkpoints newer than the one resumed from (an
  abandoned continuation, after a rollback to an older one) into ``output_dir/abandoned-<time>/``
  with a warning, so that neither rotation nor a later ``resume=True`` mixes them with this run.
- ``best_checkpoint_name`` / ``resolve_best``: the best checkpoint is stored by its directory name
  and found again in the current ``output_dir``.

What a resume does to each restored piece of state (changed settings, the best checkpoint, RNG
on another number of processes) lives with the registry entry that owns it (``registry.py``).
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from lightlike.checkpoint.atomic import cleanup_stale_temps, move_into_new_dir
from lightlike.checkpoint.lock import LOCK_NAME
from lightlike.checkpoint.manifest import CHECKPOINT_DIR_NAME, MANIFEST, checkpoint_step, find_latest_valid
from lightlike.errors import CheckpointError

if TYPE_CHECKING:
    from lightlike.config import FitConfig

log = logging.getLogger("lightlike")

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
    itself = Path(source).resolve() if source is not None else None  # a renamed folder is not newer than itself
    newer = sorted((p for p in out.iterdir() if p.is_dir() and (m := CHECKPOINT_DIR_NAME.match(p.name))
                    and int(m.group(1)) > step and p.resolve() != itself), key=checkpoint_step)
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


__all__ = ["best_checkpoint_name", "resolve_best", "resolve_resume", "set_aside",
           "set_aside_newer", "tidy_output_dir"]

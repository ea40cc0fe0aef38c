"""Deleting old checkpoints: only after the new one is committed; never the best or the newest."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from lightlike.checkpoint.atomic import cleanup_stale_temps, set_aside_in_the_way
from lightlike.checkpoint.manifest import CHECKPOINT_DIR_NAME, MANIFEST, find_latest_valid, list_checkpoints
from lightlike.checkpoint.resume import set_aside
from lightlike.errors import CheckpointError, OutputDirError
from lightlike.loggers import own_log_files

log = logging.getLogger("lightlike")


def rotate_checkpoints(output_dir: str | Path, limit: int | None, protect: Iterable[str | Path] = ()) -> list[Path]:
    """Delete the oldest committed checkpoints beyond ``limit``. Protected ones (the best) and the
    newest are kept even if that leaves more than ``limit``. Only lightlike's checkpoints count (a
    ``checkpoint-N`` of another tool is neither counted nor deleted). One that cannot be deleted (read-only) is
    left, with a warning naming it, and training goes on. Returns the deleted ones."""
    if limit is None:
        return []
    ckpts = list_checkpoints(output_dir)
    keep = {Path(p).resolve() for p in protect if p}
    if ckpts:
        keep.add(ckpts[-1].resolve())
    deletable = [p for p in ckpts if p.resolve() not in keep]
    excess = len(ckpts) - limit
    deleted = []
    for p in deletable[:max(0, excess)]:
        try:
            remove_checkpoint(p)
        except OSError as e:
            state = "partly deleted (no longer a checkpoint)" if not (p / MANIFEST).exists() else "as it was"
            log.warning("save_total_limit=%s: could not delete the old checkpoint %s (%s: %s); left it %s, and "
                        "training goes on: delete it by hand", limit, p, e.strerror or e, e.filename or p, state)
            continue
        deleted.append(p)
    return deleted


def remove_checkpoint(path: Path) -> None:
    """Delete one of lightlike's checkpoint directories, the manifest first, so that a kill
    mid-delete leaves a directory that is not a checkpoint; a symbolic link is removed as a link,
    never followed. Raises the ``OSError`` met."""
    if path.is_symlink():
        path.unlink()
        return
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path)


def prepare_output_dir(output_dir: str | Path, overwrite: bool, resume: bool | str | None = None) -> None:
    """Before a fresh (not resumed) fit, on the main rank: remove temp directories of killed
    saves; refuse an ``output_dir`` that already holds checkpoints or logs, or remove them when
    ``overwrite`` (``overwrite_output_dir=True``) says so: lightlike's checkpoints and the files
    its loggers write in ``logs/``, nothing else (``overwrite_existing_run``). With
    ``resume="auto"`` (which found no valid checkpoint to resume from: a first run killed before
    its first save, say) what is there is moved into ``output_dir/abandoned-<time>/`` with a
    warning instead of refused."""
    out = Path(output_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputDirError(f"output_dir {str(out)!r} is a file, not a directory: choose another output_dir")
    for p in cleanup_stale_temps(out):
        log.info("removed %s, left by an interrupted checkpoint save", p)
    old = list_checkpoints(out) + [p for p in (out / "logs",) if p.exists()]
    if resume == "auto":  # also the named but invalid ones: nothing here can be resumed
        old = sorted({*old, *(p for p in out.iterdir() if p.is_dir() and CHECKPOINT_DIR_NAME.match(p.name))})
    if not old:
        return
    if resume == "auto" and not overwrite:
        dest = set_aside(out, old)
        log.warning("resume='auto' found no valid checkpoint in %s: starting a fresh run; moved what an "
                    "earlier run left (%s) into %s", out, ", ".join(p.name for p in old), dest)
        return
    if not overwrite:
        names = ", ".join(p.name for p in old[:5])
        # resume=True is offered only where it would work (not for logs or weights-only checkpoints)
        resumable = find_latest_valid(out, hashes=False, resumable=True) is not None
        hint = ("pass resume=True to continue it" if resumable
                else "it holds no resumable checkpoint: pass resume='auto' to move it aside and start afresh")
        raise OutputDirError(
            f"output_dir {str(out)!r} already holds a run ({names}); {hint}, "
            "overwrite_output_dir=True to replace it, or choose another output_dir",
            offers=("resume=True" if resumable else "resume='auto'", "overwrite_output_dir=True"),
        )
    overwrite_existing_run(out)


def overwrite_existing_run(output_dir: Path) -> None:
    """``overwrite_output_dir=True``: delete what lightlike provably wrote, its checkpoints (a
    lightlike manifest) and its loggers' files in ``logs/`` (``OWN_LOG_FILES``). A ``checkpoint-N``
    without a lightlike manifest (another tool's, a copy cut short) is moved into
    ``output_dir/set-aside-<time>/``; every other file stays where it is, named in a warning.
    Nothing is trained yet: what cannot be deleted is an error naming it."""
    ckpts, logs = list_checkpoints(output_dir), own_log_files(output_dir / "logs")
    foreign = sorted(p for p in output_dir.iterdir() if CHECKPOINT_DIR_NAME.match(p.name) and p not in ckpts)
    if foreign:
        set_aside_in_the_way(output_dir, foreign)
    log.warning("overwrite_output_dir=True: removing %s", ", ".join(str(p) for p in [*ckpts, *logs]) or "nothing")
    try:
        for p in ckpts:
            remove_checkpoint(p)
        for f in logs:
            f.unlink()
    except OSError as e:
        raise CheckpointError(f"overwrite_output_dir=True could not remove {e.filename or output_dir} "
                              f"({e.strerror or e}): make it writable or remove it by hand, or choose another "
                              "output_dir") from e
    log_dir = output_dir / "logs"
    kept = sorted(p.name for p in log_dir.iterdir()) if log_dir.is_dir() else []
    if kept:
        log.warning("overwrite_output_dir=True kept %s in %s: lightlike's loggers did not write %s", ", ".join(kept),
                    log_dir, "it" if len(kept) == 1 else "them")
    elif log_dir.is_dir():
        log_dir.rmdir()

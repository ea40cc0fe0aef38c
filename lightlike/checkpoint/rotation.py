"""Deleting old checkpoints: only after the new one is committed; never the best or the newest."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from lightlike.checkpoint.atomic import cleanup_stale_temps
from lightlike.checkpoint.manifest import CHECKPOINT_DIR_NAME, MANIFEST, find_latest_valid, list_checkpoints
from lightlike.checkpoint.resume import set_aside
from lightlike.errors import OutputDirError

log = logging.getLogger("lightlike")


def rotate_checkpoints(output_dir: str | Path, limit: int | None, protect: Iterable[str | Path] = ()) -> list[Path]:
    """Delete the oldest committed checkpoints beyond ``limit``. Protected ones (the best) and the
    newest are kept even if that leaves more than ``limit``. The manifest
    goes first, so a kill mid-delete leaves a directory that is not a checkpoint."""
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
        (p / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
        deleted.append(p)
    return deleted


def prepare_output_dir(output_dir: str | Path, overwrite: bool, resume: bool | str | None = None) -> None:
    """Before a fresh (not resumed) fit, on the main rank: remove temp directories of killed
    saves; refuse an ``output_dir`` that already holds checkpoints or logs, or remove them when
    ``overwrite`` (``overwrite_output_dir=True``) says so. With ``resume="auto"`` (which found no
    valid checkpoint to resume from: a first run killed before its first save, say) what is there
    is moved into ``output_dir/abandoned-<time>/`` with a warning instead of refused."""
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
    log.warning("overwrite_output_dir=True: removing %s", ", ".join(str(p) for p in old))
    for p in old:
        shutil.rmtree(p)

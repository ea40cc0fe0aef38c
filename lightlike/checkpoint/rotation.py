"""Deleting old checkpoints: only after the new one is committed; never best, newest or resume source."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from lightlike.checkpoint.manifest import MANIFEST, list_checkpoints
from lightlike.errors import OutputDirError

log = logging.getLogger("lightlike")


def rotate_checkpoints(output_dir: str | Path, limit: int | None, protect: Iterable[str | Path] = ()) -> list[Path]:
    """Delete the oldest committed checkpoints beyond ``limit``. Protected ones (the best, the
    resume source) and the newest are kept even if that leaves more than ``limit``. The manifest
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


def prepare_output_dir(output_dir: str | Path, overwrite: bool) -> None:
    """Before a fresh (not resumed) fit: refuse an ``output_dir`` that already holds checkpoints
    or logs, or remove them when ``overwrite`` (``overwrite_output_dir=True``) says so."""
    out = Path(output_dir)
    if not out.exists():
        return
    old = list_checkpoints(out) + [p for p in (out / "logs",) if p.exists()]
    if not old:
        return
    if not overwrite:
        names = ", ".join(p.name for p in old[:5])
        raise OutputDirError(
            f"output_dir {str(out)!r} already holds a run ({names}); pass resume=True to continue "
            "it, overwrite_output_dir=True to replace it, or choose another output_dir"
        )
    log.warning("overwrite_output_dir=True: removing %s", ", ".join(str(p) for p in old))
    for p in old:
        shutil.rmtree(p)

"""Deleting old checkpoints: only after the new one is committed; never best, newest or resume source."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from lightlike.checkpoint.manifest import MANIFEST, list_checkpoints


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

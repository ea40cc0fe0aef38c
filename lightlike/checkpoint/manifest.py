"""The manifest: every file of a checkpoint with its size and sha256, written last.

A directory named ``checkpoint-N`` is a checkpoint only if its ``manifest.json`` is present,
parses, and every file it lists exists with the listed size (and hash, unless disabled).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

from lightlike.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "lightlike-checkpoint"
_NAME = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger("lightlike")


def file_hash(path: str | Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(paths: list[Path]) -> list[str]:
    """sha256 of several files at once: hashlib releases the GIL on large buffers, so threads
    hash in parallel (the big model and optimizer files together)."""
    if len(paths) <= 1:
        return [file_hash(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(file_hash, paths))


def checkpoint_step(path: str | Path) -> int:
    m = _NAME.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path} is not named checkpoint-<step>")
    return int(m.group(1))


def is_checkpoint_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and _NAME.match(p.name) is not None and (p / MANIFEST).is_file()


def verify_checkpoint(path: str | Path, hashes: bool = True) -> dict[str, Any]:
    """Return the manifest of a complete checkpoint, or raise naming the offending file."""
    p = Path(path)
    mpath = p / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{p} is not a complete checkpoint: {MANIFEST} is missing (an interrupted save?)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p}: {MANIFEST} is unreadable or not a lightlike manifest ({e})") from e
    for rel, info in files.items():
        f = p / rel
        if not f.is_file():
            raise CheckpointError(f"{p}: file {rel} listed in the manifest is missing")
        size = f.stat().st_size
        if size != info["size"]:
            raise CheckpointError(f"{p}: file {rel} is truncated or extended: expected {info['size']} bytes, "
                                  f"found {size}")
    if hashes:
        names = list(files)
        for rel, digest in zip(names, hash_files([p / rel for rel in names]), strict=True):
            if digest != files[rel]["sha256"]:
                raise CheckpointError(f"{p}: file {rel} has changed contents (sha256 mismatch: a bit flip?)")
    return manifest


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Committed checkpoint directories (with a manifest), oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if is_checkpoint_dir(p)]
    return sorted(found, key=checkpoint_step)


def find_latest_valid(output_dir: str | Path, hashes: bool = True) -> Path | None:
    """The newest checkpoint that verifies; newer broken ones are skipped with a warning."""
    out = Path(output_dir)
    candidates = [p for p in (out.iterdir() if out.is_dir() else []) if p.is_dir() and _NAME.match(p.name)]
    for p in sorted(candidates, key=checkpoint_step, reverse=True):
        try:
            verify_checkpoint(p, hashes=hashes)
            return p
        except CheckpointError as e:
            msg = f"skipping invalid checkpoint: {e}"
            log.warning(msg)
            warnings.warn(msg, stacklevel=2)
    return None

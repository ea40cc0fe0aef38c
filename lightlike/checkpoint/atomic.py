"""Atomic checkpoint directories: temp sibling, fsync every file, manifest last, rename.

A kill at any instant leaves either the previous state or the new complete checkpoint: files are
written into ``output_dir/.checkpoint-{step}.tmp-{pid}-{rand}`` (a name ``list_checkpoints``
never matches), flushed and fsynced; ``manifest.json`` is written and fsynced last; then one
``rename`` makes the directory ``checkpoint-{step}`` visible, and the parent directory is fsynced.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from lightlike.checkpoint.manifest import CHECKSUM, FORMAT, MANIFEST, hash_files, verify_checkpoint
from lightlike.checkpoint.weights import save_safetensors
from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """``with CheckpointWriter(output_dir, step) as w: w.save_torch("optimizer.pt", obj)``."""

    def __init__(self, output_dir: str | Path, step: int, meta: dict[str, Any] | None = None,
                 overwrite: bool = False, tmp_name: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.step = int(step)
        self.meta = dict(meta or {})
        self.overwrite = overwrite
        self.final_path = self.output_dir / f"checkpoint-{self.step}"
        # several ranks writing one (sharded) checkpoint pass the main rank's tmp_name
        self.tmp = self.output_dir / (tmp_name or f".checkpoint-{self.step}.tmp-{os.getpid()}-{secrets.token_hex(4)}")

    # -- writing ---------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir()
        return self

    def path_for(self, rel: str) -> Path:
        """A path inside the checkpoint for libraries that write files themselves."""
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.path_for(rel).write_bytes(data)

    def write_json(self, rel: str, obj: Any) -> None:
        self.path_for(rel).write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n")

    def save_torch(self, rel: str, obj: Any) -> None:
        torch.save(obj, self.path_for(rel))

    def save_safetensors(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        save_safetensors(tensors, self.path_for(rel), metadata)

    # -- commit ----------------------------------------------------------------------------------
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            self._commit()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _commit(self) -> None:
        import datetime

        paths = [f for f in sorted(self.tmp.rglob("*")) if f.is_file()]
        for f in paths:
            _fsync_path(f)
        files = {f.relative_to(self.tmp).as_posix(): {"size": f.stat().st_size, CHECKSUM: digest}
                 for f, digest in zip(paths, hash_files(paths), strict=True)}
        for d in sorted({f.parent for f in self.tmp.rglob("*")} | {self.tmp}, key=lambda p: len(p.parts), reverse=True):
            _fsync_path(d)
        manifest = {"format": FORMAT, "version": 1, "step": self.step, "files": files, "meta": self.meta,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        mpath = self.tmp / MANIFEST
        with open(mpath, "w") as fh:
            json.dump(manifest, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_path(self.tmp)
        trash = None
        if self.final_path.exists():
            try:
                verify_checkpoint(self.final_path, hashes=False)
                valid = True
            except CheckpointError:
                valid = False
            if valid and not self.overwrite:
                raise CheckpointError(f"{self.final_path} already exists; refusing to overwrite it")
            if not valid:
                log.warning("replacing %s, which is not a complete checkpoint", self.final_path)
            trash = self.output_dir / f".trash-{self.final_path.name}-{secrets.token_hex(4)}"
            (self.final_path / MANIFEST).unlink(missing_ok=True)  # never a half-deleted valid checkpoint
            os.rename(self.final_path, trash)
        os.rename(self.tmp, self.final_path)
        _fsync_path(self.output_dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def cleanup_stale_temps(output_dir: str | Path, force: bool = False) -> list[Path]:
    """Remove temp/trash directories left by killed processes (dead pids; all with force)."""
    out = Path(output_dir)
    removed: list[Path] = []
    if not out.is_dir():
        return removed
    for p in out.iterdir():
        if p.name.startswith(".trash-"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        elif p.name.startswith(".checkpoint-") and ".tmp-" in p.name:
            pid = int(p.name.split(".tmp-")[1].split("-")[0])
            if force or not _alive(pid):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

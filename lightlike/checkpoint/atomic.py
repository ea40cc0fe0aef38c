"""Atomic checkpoint directories: temp sibling, fsync every file, manifest last, rename.

A kill at any instant leaves either the previous state or the new complete checkpoint: files are
written into ``output_dir/.checkpoint-{step}.tmp-{pid}-{rand}`` (a name ``list_checkpoints``
never matches), flushed and fsynced; ``manifest.json`` is written and fsynced last; then one
``rename`` makes the directory ``checkpoint-{step}`` visible, and the parent directory is fsynced.

Files written through the writer's own methods are checksummed (XXH3-128, ``manifest.CHECKSUM``)
as they are written, not read back: ``torch.save`` streams through the hash (in place of the
per-record CRC-32 of its zip container, which ``torch.load`` never checks, so the file costs what
a plain ``torch.save`` costs), and a file a library writes (``model.safetensors``) is checksummed
and fsynced by a helper thread while the next one is written. Files a library writes through
``path_for`` are read back at commit.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import json
import logging
import os
import re
import resource
import secrets
import shutil
import stat
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from lightlike.checkpoint.manifest import (
    CHECKSUM,
    FORMAT,
    MANIFEST,
    VERSION,
    bytes_hash,
    file_hash,
    hash_files,
    new_hasher,
    verify_checkpoint,
    written_by_lightlike,
)
from lightlike.checkpoint.weights import save_safetensors
from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checksummed:
    """A write-only file that keeps the checksum (``manifest.CHECKSUM``) of everything written
    through it: ``hexdigest()``. With a thread pool (``pool``), a buffer of ``OVERLAP_BYTES`` or
    more is hashed by a helper thread while this one writes it (both release the GIL), so the
    checksum costs no time when there is a core for it; either way the buffer is hashed before
    ``write`` returns, while the caller still owns it, and the buffers in the order written.
    ``overlapped`` and ``inline`` count the writes hashed each way.
    (``CheckpointWriter.save_torch`` writes through it; public so that a test can watch it.)"""

    def __init__(self, fh: Any, pool: ThreadPoolExecutor | None = None) -> None:
        self.fh, self.hash, self.pool = fh, new_hasher(CHECKSUM), pool
        self.overlapped = self.inline = 0

    def write(self, data: Any) -> int:
        if self.pool is None or memoryview(data).nbytes < OVERLAP_BYTES:
            self.inline += 1
            self.hash.update(data)
            return self.fh.write(data)
        self.overlapped += 1
        hashed = self.pool.submit(self.hash.update, data)
        try:
            return self.fh.write(data)
        finally:
            hashed.result()

    def hexdigest(self) -> str:
        return str(self.hash.hexdigest())

    def flush(self) -> None:
        self.fh.flush()


OVERLAP_BYTES = 1 << 20  # smaller writes (zip headers, pickle data) are checksummed inline


def _fsynced(path: Path, digest: str | None) -> str:
    """fsync a written file; its checksum, read back when not known from the write."""
    fsync_path(path)
    return digest if digest is not None else file_hash(path)


class CheckpointWriter:
    """``with CheckpointWriter(output_dir, step) as w: w.save_torch("optimizer.pt", obj)``.

    A ``checkpoint-{step}`` already there when it commits: a complete one is refused, or replaced
    with ``overwrite=True``; anything lightlike did not write (no lightlike manifest: another
    tool's folder, a copy cut short) is never deleted but moved into ``output_dir/set-aside-<time>/``
    with a warning. Every file gets the mode ``open()`` gives a new file (0o666 less the umask)."""

    def __init__(self, output_dir: str | Path, step: int, meta: dict[str, Any] | None = None,
                 overwrite: bool = False, tmp_name: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.step = int(step)
        self.meta = dict(meta or {})
        self.overwrite = overwrite
        self.final_path = self.output_dir / f"checkpoint-{self.step}"
        # several ranks writing one (sharded) checkpoint pass the main rank's tmp_name
        self.tmp = self.output_dir / (tmp_name or f".checkpoint-{self.step}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        # the writer that commits (entered): checksums of written files, as they are fsynced
        self._pool: ThreadPoolExecutor | None = None
        self._done: dict[str, Future[str]] = {}
        self._mode = 0o644  # of every file: what open() gives a new file here (set on entering)

    # -- writing ---------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir()
        self._mode = _new_file_mode(self.tmp)
        # fsync + checksum of finished files, and the checksum of a torch.save's storages
        self._pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="lightlike-fsync")
        return self

    def _written(self, rel: str, path: Path, digest: str | None = None) -> None:
        """Hand a closed file to the helper thread: fsync it (and checksum it if not known)."""
        self._same_mode(path)
        if self._pool is not None:
            self._done[rel] = self._pool.submit(_fsynced, path, digest)

    def _same_mode(self, path: Path) -> None:
        """Every file of a checkpoint gets the mode ``open()`` gives a new file (0o666 less the
        umask); safetensors, for one, writes ``model.safetensors`` with 0o600."""
        if stat.S_IMODE(path.stat().st_mode) != self._mode:
            os.chmod(path, self._mode)

    def path_for(self, rel: str) -> Path:
        """A path inside the checkpoint for libraries that write files themselves."""
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.path_for(rel)
        path.write_bytes(data)
        self._written(rel, path, bytes_hash(data))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + "\n").encode())

    def save_torch(self, rel: str, obj: Any) -> None:
        path = self.path_for(rel)
        with open(path, "wb") as fh:
            sink = Checksummed(fh, self._pool)
            with _zip_crc_off():
                torch.save(obj, sink)  # type: ignore[arg-type]  # write() and flush() are all it uses
        self._written(rel, path, sink.hexdigest())

    def save_safetensors(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        path = self.path_for(rel)
        save_safetensors(tensors, path, metadata)
        self._written(rel, path)  # checksummed by the helper thread while the next file is written

    # -- commit ----------------------------------------------------------------------------------
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self._shutdown()
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        self.seal()
        self.publish()

    def seal(self) -> None:
        """fsync and checksum every file and write the manifest: the temp directory is then a
        complete checkpoint, not yet under its name (``publish``). Removed if this fails."""
        try:
            self._seal()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            self._shutdown()

    def publish(self) -> None:
        """Give the sealed checkpoint its name, ``checkpoint-N`` (atomically replacing one)."""
        try:
            self._publish()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # no helper thread still touches the temp directory
            self._pool = None

    def _seal(self) -> None:
        paths = [f for f in sorted(self.tmp.rglob("*")) if f.is_file()]
        rels = [f.relative_to(self.tmp).as_posix() for f in paths]
        known = {rel: self._done[rel].result() for rel in rels if rel in self._done}
        others = [f for f, rel in zip(paths, rels, strict=True) if rel not in known]  # written by libraries
        for f in others:
            self._same_mode(f)
            fsync_path(f)
        digests = dict(zip([rel for rel in rels if rel not in known], hash_files(others), strict=True))
        digests.update(known)
        files = {rel: {"size": f.stat().st_size, CHECKSUM: digests[rel]} for f, rel in zip(paths, rels, strict=True)}
        for d in sorted({f.parent for f in self.tmp.rglob("*")} | {self.tmp}, key=lambda p: len(p.parts), reverse=True):
            fsync_path(d)
        manifest = {"format": FORMAT, "version": VERSION, "step": self.step, "files": files, "meta": self.meta,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        mpath = self.tmp / MANIFEST
        with open(mpath, "w") as fh:
            json.dump(manifest, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_path(self.tmp)

    def _publish(self) -> None:
        trash, swapped = None, False
        if self.final_path.exists() or self.final_path.is_symlink():
            ours = written_by_lightlike(self.final_path) and not self.final_path.is_symlink()
            valid = ours and _verifies(self.final_path)
            if valid and not self.overwrite:
                raise CheckpointError(f"{self.final_path} already exists; refusing to overwrite it")
            if not (ours and self.overwrite):  # never deleted: lightlike did not write it, or was not asked to
                set_aside_in_the_way(self.output_dir, [self.final_path])
            else:  # lightlike's, and to be replaced
                if not valid:
                    log.warning("replacing %s, which is not a complete checkpoint", self.final_path)
                swapped = _exchange(self.tmp, self.final_path)  # one atomic swap: checkpoint-N exists throughout
                trash = self.tmp if swapped else self.output_dir / f".trash-{self.final_path.name}-{secrets.token_hex(4)}"
                old = trash if swapped else self.final_path
                (old / MANIFEST).unlink(missing_ok=True)  # never a half-deleted valid checkpoint
                if not swapped:  # no renameat2 here: a window of two renames without checkpoint-N
                    os.rename(self.final_path, trash)
        if not swapped:
            os.rename(self.tmp, self.final_path)
        fsync_path(self.output_dir)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def _verifies(path: Path) -> bool:
    try:
        verify_checkpoint(path, hashes=False)
    except CheckpointError:
        return False
    return True


#: Prefix of the directory that receives what was in the way of a new checkpoint.
SET_ASIDE = "set-aside-"


def set_aside_in_the_way(output_dir: str | Path, paths: list[Path]) -> Path:
    """``paths`` (``checkpoint-N`` entries of ``output_dir``) are in the way of this run's
    checkpoints and are not to be deleted (lightlike did not write them, or another run did):
    move them into a new ``output_dir/set-aside-<UTC time>/``, with a warning naming where each
    went, or raise saying what to do. Returns the new directory."""
    whys = [_what_it_is(p) for p in paths]
    try:
        dest = move_into_new_dir(output_dir, paths, SET_ASIDE)
    except OSError as e:
        raise CheckpointError(f"{', '.join(map(str, paths))} ({'; '.join(whys)}) in the way of this run's checkpoints "
                              f"could not be moved aside ({e.strerror or e}): move or remove it by hand") from e
    for p, why in zip(paths, whys, strict=True):
        log.warning("%s is in the way of this run's checkpoints (%s); moved it to %s", p, why, dest / p.name)
    return dest


def _what_it_is(path: Path) -> str:
    if not written_by_lightlike(path):
        return "lightlike did not write it: no lightlike manifest"
    return "a complete checkpoint that this fit did not write" if _verifies(path) else \
        "an incomplete or damaged lightlike checkpoint"


def move_into_new_dir(output_dir: str | Path, paths: list[Path], prefix: str) -> Path:
    """Move ``paths`` (entries of ``output_dir``) into a new ``output_dir/<prefix><UTC time>/``
    (which ``list_checkpoints``, rotation and ``resume=True`` never look into). Returns it."""
    out = Path(output_dir)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest, n = out / f"{prefix}{stamp}", 1
    while dest.exists():
        n += 1
        dest = out / f"{prefix}{stamp}-{n}"
    dest.mkdir()
    for p in paths:
        os.rename(p, dest / p.name)
    fsync_path(out)
    return dest


_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
         errno.EFBIG: "file too large"}
_OS_ERROR = re.compile(r"os error (\d+)")  # how a Rust library (safetensors) names the OSError it met


def full_disk_errno(error: BaseException) -> int | None:
    """ENOSPC, EDQUOT or EFBIG where ``error`` or an error in its chain is one: torch.save raises
    a RuntimeError ("unexpected pos ...") with the OSError only in its context; safetensors names
    the errno in its message only."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (m := _OS_ERROR.search(str(e))):
            code = int(m.group(1))
        if code in _FULL:
            return code
        e = e.__cause__ or e.__context__
    return None


def not_saved_error(error: BaseException, output_dir: str | Path, step: int, needed: int | None) -> CheckpointError | None:
    """The one error for a save that ran out of room (None for any other failure): which
    checkpoint was not saved, where, what was needed and what is free, or the file-size limit."""
    code = full_disk_errno(error)
    if code is None:
        return None
    out = Path(output_dir)
    need = f"needed ~{_size(needed)}" if needed else "size unknown"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        what = (f"a file-size limit (RLIMIT_FSIZE, `ulimit -f`: {_size(limit)}) stopped a write into {out} "
                f"({need}); raise the limit (`ulimit -f unlimited`)" if limit != resource.RLIM_INFINITY else
                f"a file in {out} would be larger than its file system allows ({need}); choose an output_dir on "
                "another file system")
    else:
        with contextlib.suppress(OSError):
            need += f", {_size(shutil.disk_usage(out).free)} free"
        what = (f"{_FULL[code]} at {out} ({need}); free some space (or lower save_total_limit), or choose an "
                "output_dir with more room")
    return CheckpointError(f"checkpoint-{step} not saved: {_FULL[code] + ': ' if code == errno.EFBIG else ''}{what}. "
                           "The earlier checkpoints are untouched; the partial one was not committed")


def _size(n: float) -> str:
    """``512 bytes``, ``3.2 kB``, ``1.5 GB``."""
    units, i = ("bytes", "kB", "MB", "GB", "TB"), 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{int(n)} bytes" if i == 0 else f"{n:.1f} {units[i]}"


def _new_file_mode(directory: Path) -> int:
    """The mode ``open()`` gives a new file in ``directory`` (0o666 less the umask, or what a
    default ACL says), read from a probe file: the umask cannot be read without changing it."""
    probe = directory / ".mode"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    call or the file system does not support it."""
    if not sys.platform.startswith("linux"):
        return False

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


class _zip_crc_off:
    """``torch.save`` without the CRC-32 of each zip record (the writer checksums the whole file)."""

    def __enter__(self) -> None:
        self.was = getattr(torch.serialization, "get_crc32_options", lambda: None)()
        if self.was:
            torch.serialization.set_crc32_options(False)

    def __exit__(self, *exc: object) -> None:
        if self.was:
            torch.serialization.set_crc32_options(True)


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

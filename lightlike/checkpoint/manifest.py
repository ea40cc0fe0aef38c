"""The manifest: every file of a checkpoint with its size and checksum, written last.

A directory named ``checkpoint-N`` is a checkpoint only if its ``manifest.json`` is present,
parses, and every file it lists exists with the listed size (and checksum, unless disabled).

The checksum guards against torn writes, truncation and bit flips, not against tampering. New
manifests hold XXH3-128 (``xxhash.xxh3_128``; 30 GB/s here, as fast as memory is read, against
4.2 GB/s for CRC-32 and 14 GB/s for CRC-32C): any random corruption goes unseen with a chance
of 1 in 2**128. Each file's entry names its algorithm by its key; manifests written with CRC-32
(``crc32``, ``zlib.crc32``) still verify.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import xxhash

from lightlike.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "lightlike-checkpoint"
VERSION = 1  # of the manifest's layout: a newer one is refused by name, not misread
CHECKPOINT_DIR_NAME = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger("lightlike")


#: the checksum written into new manifests (per file: ``{"size": ..., CHECKSUM: hex}``)
CHECKSUM = "xxh3_128"
#: the checksums a manifest's file entries may hold: ``crc32`` in manifests written before XXH3
CHECKSUMS = (CHECKSUM, "crc32")


def new_hasher(algorithm: str = CHECKSUM) -> Any:
    """A streaming hash object (``update``, ``hexdigest``): XXH3-128, or any of ``hashlib``'s.
    Both release the GIL while they hash a large buffer."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def bytes_hash(data: Any, algorithm: str = CHECKSUM) -> str:
    """Hex checksum of a buffer, as ``file_hash`` gives it for a file holding those bytes."""
    if algorithm == "crc32":
        return f"{zlib.crc32(data):08x}"
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def file_hash(path: str | Path, algorithm: str = CHECKSUM, chunk: int = 1 << 20, *, part_bytes: int | None = None,
              max_parts: int | None = None) -> str:
    """Hex checksum of a file: ``xxh3_128`` (32 hex digits), ``crc32`` (8) or any of
    ``hashlib``'s. XXH3 and ``hashlib`` read the file through a memory map (``mapped_hash``).
    CRC-32 reads into one reused ``chunk``-byte buffer that stays in the CPU cache, and a large
    file's CRC-32 is computed in parts by several threads and the parts' CRCs combined: up to
    ``max_parts`` parts (default: the cores, at most 8) of at least ``part_bytes`` (default
    ``PART_BYTES``) each, every part read by ``crc_range``. (The two parameters let a test split
    small files.)"""
    if algorithm != "crc32":
        return mapped_hash(path, new_hasher(algorithm))
    size = os.path.getsize(path)
    most = max_parts if max_parts is not None else min(os.cpu_count() or 1, 8)
    parts = min(most, size // (part_bytes or PART_BYTES))
    if parts <= 1:
        crc = 0
        for block in _blocks(path, 0, size, chunk):
            crc = zlib.crc32(block, crc)
        return f"{crc:08x}"
    bounds = [size * i // parts for i in range(parts + 1)]

    with ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="lightlike-crc") as pool:
        rest = [(pool.submit(crc_range, path, a, b - a, chunk), b - a) for a, b in pairwise(bounds[1:])]
        crc = crc_range(path, 0, bounds[1], chunk)
        for fut, length in rest:
            crc = crc32_combine(crc, fut.result(), length)
    return f"{crc:08x}"


def mapped_hash(path: str | Path, hasher: Any) -> str:
    """``hasher``'s hex digest of a file's bytes, hashed where they lie: the file is mapped into
    memory, so bytes in the page cache are hashed without a copy (30 GB/s here, against 14 GB/s
    read into a buffer). As with any memory map (``safetensors`` loads through one), a read
    error of the disk under it ends the process (SIGBUS) rather than raising ``OSError``."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                hasher.update(view)
    return hasher.hexdigest()


PART_BYTES = 32 << 20  # a file is split into parts of at least this size


def _blocks(path: str | Path, start: int, length: int, chunk: int) -> Iterator[memoryview]:
    """``length`` bytes of a file from ``start`` (fewer if it is shorter now), in blocks read
    into one reused buffer."""
    view = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0 and (n := f.readinto(view[:min(chunk, length)])):
            yield view[:n]
            length -= n


def crc_range(path: str | Path, start: int, length: int, chunk: int) -> int:
    """The CRC-32 of ``length`` bytes of a file from ``start``: one part of ``file_hash``'s
    split (looked up by name at each call, so a test can watch which parts are read)."""
    crc = 0
    for block in _blocks(path, start, length, chunk):
        crc = zlib.crc32(block, crc)
    return crc


_CRC_POLY = 0xEDB88320  # CRC-32 (zlib's), bit-reversed


def _mult_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (bit-reversed polynomials, as zlib's crc32.c)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
        m >>= 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and
    ``len(b)``: zlib's ``crc32_combine``, which Python's ``zlib`` module does not expose. It
    multiplies ``crc1`` by x^(8 * len2) modulo the polynomial (square-and-multiply)."""
    x2n, p = 1 << 30, 1 << 31  # x^1, x^0
    n = 8 * len2
    while n:
        if n & 1:
            p = _mult_mod_p(x2n, p)
        x2n = _mult_mod_p(x2n, x2n)
        n >>= 1
    return _mult_mod_p(p, crc1) ^ crc2


def hash_files(paths: list[Path], algorithms: list[str] | None = None) -> list[str]:
    """Checksums of several files at once: xxhash, zlib and hashlib release the GIL on large
    buffers, so threads check the big model and optimizer files in parallel."""
    algos = algorithms or [CHECKSUM] * len(paths)
    if len(paths) <= 1:
        return [file_hash(p, a) for p, a in zip(paths, algos, strict=True)]

    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(file_hash, paths, algos))


def checkpoint_step(path: str | Path) -> int:
    m = CHECKPOINT_DIR_NAME.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path} is not named checkpoint-<step>")
    return int(m.group(1))


def is_checkpoint_dir(path: str | Path) -> bool:
    """A ``checkpoint-N`` directory with lightlike's manifest (``written_by_lightlike``): what
    lightlike counts, rotates and may remove. Another tool's ``checkpoint-N`` is none of these, nor
    is a symbolic link (what it leads to may be another run's: it is never followed to delete)."""
    p = Path(path)
    return (CHECKPOINT_DIR_NAME.match(p.name) is not None and not p.is_symlink() and p.is_dir()
            and written_by_lightlike(p))


def written_by_lightlike(path: str | Path) -> bool:
    """Whether the directory holds a ``manifest.json`` that lightlike wrote (it parses and names
    lightlike's format), whether or not the files it lists are intact."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def verify_checkpoint(path: str | Path, hashes: bool = True) -> dict[str, Any]:
    """Return the manifest of a complete checkpoint, or raise naming the offending file."""
    check = start_verifying(path, hashes)
    check.wait()
    return check.manifest


def start_verifying(path: str | Path, hashes: bool = True) -> Verification:
    """Check the manifest and every file's size now (raising naming the offending file), and
    start the checksums in threads: ``wait()`` on the returned ``Verification`` before using
    anything read from the files. So a load reads its files while they are checksummed."""
    p = Path(path)
    mpath = p / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{p} is not a complete checkpoint: {MANIFEST} is missing (an interrupted save?)")
    try:
        manifest = json.loads(mpath.read_text())
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        files = manifest["files"]
        _check_structure(manifest, files)
    except (ValueError, KeyError, TypeError) as e:  # a structure the checks below would trip over, too
        raise CheckpointError(f"{p}: {MANIFEST} is unreadable or not a lightlike manifest ({e})") from e
    if manifest["version"] > VERSION:
        raise CheckpointError(f"{p} was written by a newer lightlike (manifest version {manifest.get('version')!r}; "
                              f"this one reads up to {VERSION}): upgrade lightlike to load it")
    for rel, info in files.items():
        f = p / rel
        if not f.is_file():
            raise CheckpointError(f"{p}: file {rel} listed in the manifest is missing")
        size = f.stat().st_size
        if size != info["size"]:
            raise CheckpointError(f"{p}: file {rel} is truncated or extended: expected {info['size']} bytes, "
                                  f"found {size}")
    return Verification(p, manifest, hashes)


class Verification:
    """The checksums of a checkpoint's files (its manifest's), computed in threads from
    construction on. ``wait()`` raises ``CheckpointError`` naming a file whose contents changed;
    ``first()`` wraps reading the files, so that an error the reading meets (a damaged pickle,
    say) is reported as the changed file it comes from, when one did."""

    def __init__(self, path: Path, manifest: dict[str, Any], hashes: bool) -> None:
        self.path, self.manifest = path, manifest
        files = manifest["files"]
        self._expected = [(rel, algo, files[rel][algo]) for rel in files
                          for algo in [entry_checksum(files[rel])]] if hashes else []
        self._pool: ThreadPoolExecutor | None = None
        self._digests: Any = []
        self._error: CheckpointError | None = None
        if self._expected:
            self._pool = ThreadPoolExecutor(max_workers=min(len(self._expected), os.cpu_count() or 1, 8),
                                            thread_name_prefix="lightlike-verify")
            self._digests = [self._pool.submit(file_hash, path / rel, algo) for rel, algo, _ in self._expected]

    def wait(self) -> None:
        if self._pool is not None:
            try:
                for (rel, algo, expected), digest in zip(self._expected, self._digests, strict=True):
                    if digest.result() != expected:
                        self._error = CheckpointError(
                            f"{self.path}: file {rel} has changed contents ({algo} mismatch: a bit flip?)")
                        break
            finally:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        if self._error is not None:
            raise self._error

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.wait()  # a changed file is what to report, if one is
            raise
        finally:
            self.wait()


def entry_checksum(info: dict[str, Any]) -> str:
    """The algorithm of a file entry of a manifest that ``verify_checkpoint`` has read: the first
    of ``CHECKSUMS`` it holds."""
    return next(algo for algo in CHECKSUMS if isinstance(info.get(algo), str))


def _check_structure(manifest: dict[str, Any], files: Any) -> None:
    """``ValueError`` where a manifest that parses is not shaped as the writer shapes one (a
    ``version`` number, a ``files`` object of ``{"size": int, <one of CHECKSUMS>: hex}`` entries,
    a ``meta`` object), so that a damaged one is refused by name, as a truncated one is, not met
    later as a ``KeyError``."""
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"'version' is {version!r}, not a number")
    if not isinstance(files, dict):
        raise ValueError(f"'files' is a {type(files).__name__}, not an object")
    for rel, info in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            raise ValueError(f"the entry {rel!r} names a file outside the checkpoint")
        if not isinstance(info, dict):
            raise ValueError(f"the entry of {rel!r} is a {type(info).__name__}, not an object")
        size = info.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"the entry of {rel!r} has no size" if "size" not in info
                             else f"the entry of {rel!r} has size {size!r}")
        if not any(isinstance(info.get(algo), str) for algo in CHECKSUMS):
            raise ValueError(f"the entry of {rel!r} has no checksum ({' or '.join(CHECKSUMS)})")
    if "meta" in manifest and not isinstance(manifest["meta"], dict):
        raise ValueError(f"'meta' is {manifest['meta']!r}, not an object")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Committed checkpoint directories (with lightlike's manifest), oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if is_checkpoint_dir(p)]
    return sorted(found, key=checkpoint_step)


def find_latest_valid(output_dir: str | Path, hashes: bool = True, resumable: bool = False,
                      skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """The newest checkpoint that verifies; newer broken ones are skipped with a warning (and
    appended to ``skipped`` as (path, why), where given). ``resumable``: skip weights-only
    checkpoints (``save_only_model``), which cannot resume a run."""
    out = Path(output_dir)
    candidates = [p for p in (out.iterdir() if out.is_dir() else []) if p.is_dir() and CHECKPOINT_DIR_NAME.match(p.name)]
    for p in sorted(candidates, key=checkpoint_step, reverse=True):
        try:
            manifest = verify_checkpoint(p, hashes=hashes)
            if resumable and (manifest.get("meta") or {}).get("kind") == "model":
                log.info("skipping %s: it holds weights only (save_only_model), not a resumable state", p.name)
                if skipped is not None:
                    skipped.append((p, "it holds weights only (save_only_model), not a resumable state"))
                continue
            return p
        except (CheckpointError, OSError) as e:  # OSError: moved away by the main rank meanwhile
            msg = f"skipping invalid checkpoint: {e}"
            if skipped is not None:
                skipped.append((p, str(e)))
            log.warning(msg)
            warnings.warn(msg, stacklevel=2)
    return None

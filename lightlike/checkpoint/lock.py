"""One fit per ``output_dir``: an exclusive OS lock held for the whole of ``fit()``.

Two runs started into one ``output_dir`` would both "succeed" and interleave their checkpoints
(``checkpoint-N`` of one run replacing the other's). The main rank therefore takes
``fcntl.flock`` on ``output_dir/.lightlike.lock`` before it looks at or changes anything there,
and holds it until the fit ends (on success and on error, over every out-of-memory retry of
the fit). The lock belongs to the open file, not to the file's existence: the kernel releases it
when the process dies, SIGKILL included, so a killed run leaves no stale lock; the file only says
who holds it (pid, host, start time), for the error a second run gets. Forked children (DataLoader
workers) do not keep it: their copy of the descriptor is closed as they start.

Taking the lock also shows that ``output_dir`` can be written (the directory is created, and a
probe file created and removed), so a read-only path fails at set-up, not at the first save after
hours of training. ``validate``, ``test`` and ``predict`` only read checkpoints: they take no lock.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightlike.errors import ConfigError, OutputDirError
from lightlike.utils.failfast import decided_on_main

log = logging.getLogger("lightlike")
#: The lock file in ``output_dir`` (hidden; removed when the fit ends).
LOCK_NAME = ".lightlike.lock"
_HELD: set[int] = set()  # descriptors of the locks this process holds (closed in forked children)


def _close_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class OutputDirLock:
    """``acquire`` / ``release`` of the lock on one ``output_dir`` (the main rank's business;
    ``output_dir_locked`` is the context manager the Fitter uses)."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self.fd: int | None = None
        self.created: list[Path] = []  # the folders acquire made (deepest first): removed again if left empty

    def acquire(self) -> None:
        """Create ``output_dir`` if needed, check that it can be written, and lock it; raise
        ``ConfigError`` naming the holder when another process holds it."""
        out = self.output_dir
        if out.exists() and not out.is_dir():
            raise OutputDirError(f"output_dir {str(out)!r} is a file, not a directory: choose another output_dir")
        try:
            self.created = [p for p in (out, *out.parents) if not p.exists()]
            out.mkdir(parents=True, exist_ok=True)
            self.fd = self._lock()
            _probe(out)
            if self.fd is not None:  # who holds it, for the error a second run gets
                holder = {"pid": os.getpid(), "host": socket.gethostname(),
                          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError as e:
            self.release()
            raise _unwritable(out, e) from e

    def _lock(self) -> int | None:
        """The locked descriptor of the lock file (None, with a warning, on a file system without
        locks). The file a holder removes as it releases may be locked here in between: locked, it
        must still be the file under the name, else again."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise ConfigError(self._in_use(holder), settings=("output_dir",)) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                log.warning("output_dir %s cannot be locked (%s: its file system has no locks): nothing stops "
                            "another run from writing into it meanwhile", self.output_dir, e.strerror)
                return None
            except BaseException:
                os.close(fd)
                raise
            try:
                named = os.stat(self.path)
            except FileNotFoundError:
                named = None
            mine = os.fstat(fd)
            if named is not None and (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino):
                _HELD.add(fd)
                return fd
            os.close(fd)  # removed by the holder that released it: lock the file under the name now
        raise OSError(errno.EAGAIN, f"could not lock {self.path}: it is removed and created again continually")

    def _in_use(self, holder: dict[str, Any]) -> str:
        who = (f"process {holder['pid']} on host {holder.get('host', '?')}"
               f"{' (started ' + str(holder['started']) + ')' if holder.get('started') else ''}"
               if "pid" in holder else "another process (just starting: it has not written its pid yet)")
        return (f"output_dir {str(self.output_dir)!r} is in use by another run: {who} holds its lock "
                f"{str(self.path)!r}. Two runs in one output_dir would overwrite each other's checkpoints: wait "
                "for that run to end (or stop it), or choose another output_dir")

    def release(self) -> None:
        """Remove the lock file and unlock (a no-op where nothing is held). Unlocking releases
        the lock for every copy of the descriptor, not only this one. The folders ``acquire``
        created are removed again while they are empty (a fit that failed before writing
        anything leaves no trace; ``rmdir`` never removes a folder that holds a file)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            _HELD.discard(fd)
            try:
                with contextlib.suppress(OSError):  # still the locked file: no other process can have replaced it
                    os.unlink(self.path)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        created, self.created = self.created, []
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # not empty (the fit wrote into it), or gone: kept as it is
                break


@contextlib.contextmanager
def output_dir_locked(strategy: Any, output_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Around a whole ``fit()``: the main rank holds the lock on ``output_dir``; a refusal (in use,
    not writable) reaches every rank as one error at the same point."""
    lock = OutputDirLock(output_dir)
    decided_on_main(strategy, lock.acquire)
    try:
        yield
    finally:
        lock.release()


def _probe(out: Path) -> None:
    """Create and remove a file in ``out``: raises what a checkpoint save would meet later."""
    fd, name = tempfile.mkstemp(prefix=".lightlike-write-test-", dir=out)
    os.close(fd)
    os.unlink(name)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _unwritable(out: Path, error: OSError) -> ConfigError:
    return ConfigError(f"output_dir {str(out)!r} cannot be written ({error.strerror or error}): make it writable "
                       "or choose another output_dir (checked before training, so that no save fails after it)",
                       settings=("output_dir",))

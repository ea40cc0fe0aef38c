"""Metrics files: ``metrics.csv`` (long format) and ``metrics.jsonl`` (one object per log).

Both are appended to and flushed at every call, so a killed run leaves every completed row on
disk. ``resume(step)`` rewrites the file atomically (temp file, fsync, ``os.replace``) keeping
only the rows with ``step <= step``; a torn last line (the process died mid-write) is dropped.
NaN and inf are written as they are: ``nan``/``inf`` in the CSV (``float()`` reads them back),
``NaN``/``Infinity`` in the JSONL (Python's ``json`` reads them back).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from lightlike.loggers.base import Logger

CSV_HEADER = ("step", "name", "value")


def _complete_text(path: Path) -> str:
    """The file's text up to its last newline (a line without one was torn by a crash)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    end = text.rfind("\n")
    return text[: end + 1] if end >= 0 else ""


def _atomic_write(path: Path, write: Callable[[IO[str]], None]) -> None:
    """Write ``path`` through a temp file in the same directory, fsync it, then replace."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable; not possible everywhere (e.g. Windows)
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _step_of(raw: Any) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


class _AppendingLogger(Logger):
    """A metrics file opened lazily in append mode, flushed at every call."""

    filename = ""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.path = self.log_dir / self.filename
        self._fh: IO[str] | None = None

    def _open(self) -> IO[str]:
        if self._fh is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._fh = open(self.path, "a", encoding="utf-8", newline="")
            if new:
                self._write_header(self._fh)
        return self._fh

    def _write_header(self, fh: IO[str]) -> None:
        pass

    def last_written_ns(self) -> int | None:
        """When the file was last written (``build_loggers`` compares it with the resumes since)."""
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return None

    def finalize(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            self._fh.close()
            self._fh = None


class CSVLogger(_AppendingLogger):
    """``log_dir/metrics.csv`` with header ``step,name,value``: one row per number, so train
    and eval logs with different keys share one file."""

    filename = "metrics.csv"

    def _write_header(self, fh: IO[str]) -> None:
        csv.writer(fh, lineterminator="\n").writerow(CSV_HEADER)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        fh = self._open()
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerows([int(step), str(k), repr(float(v))] for k, v in metrics.items())
        fh.flush()

    def resume(self, step: int) -> None:
        self.finalize()
        if not self.path.exists():
            return
        kept = [
            row
            for row in csv.reader(io.StringIO(_complete_text(self.path), newline=""))
            if len(row) == 3 and (s := _step_of(row[0])) is not None and s <= step
        ]

        def write(fh: IO[str]) -> None:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(CSV_HEADER)
            writer.writerows(kept)

        _atomic_write(self.path, write)


class JSONLLogger(_AppendingLogger):
    """``log_dir/metrics.jsonl``: ``{"step": N, **metrics}`` per call; NaN/inf kept as literals."""

    filename = "metrics.jsonl"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        fh = self._open()
        record = {"step": int(step), **{str(k): float(v) for k, v in metrics.items()}}
        fh.write(json.dumps(record) + "\n")
        fh.flush()

    def resume(self, step: int) -> None:
        self.finalize()
        if not self.path.exists():
            return
        kept = []
        for line in _complete_text(self.path).splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # blank or corrupt line
            if isinstance(obj, dict) and (s := _step_of(obj.get("step"))) is not None and s <= step:
                kept.append(line)
        _atomic_write(self.path, lambda fh: fh.writelines(line + "\n" for line in kept))


def read_csv_metrics(path: str | Path) -> list[tuple[int, str, float]]:
    """Rows of a ``metrics.csv`` as ``(step, name, value)``, in file order."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows: Iterable[list[str]] = list(csv.reader(fh))[1:]
    return [(int(s), n, float(v)) for s, n, v in rows]


def read_jsonl_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl``, in file order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


__all__ = ["CSVLogger", "JSONLLogger", "read_csv_metrics", "read_jsonl_metrics"]

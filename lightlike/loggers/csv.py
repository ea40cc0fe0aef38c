"""Metrics files: ``metrics.csv`` (long format) and ``metrics.jsonl`` (one object per log)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from lightlike.loggers.base import Logger


def _rewrite_keeping(path: Path, keep: Any) -> None:
    """Rewrite ``path`` keeping the lines for which ``keep(line)`` is true; atomic replace."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as fh:
        fh.writelines(line for i, line in enumerate(lines) if keep(i, line))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class CSVLogger(Logger):
    """``log_dir/metrics.csv`` with header ``step,name,value``: robust to changing keys."""

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: Any = None

    def _open(self) -> Any:
        if self._fh is None:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._fh = open(self.path, "a", newline="")
            if new:
                self._fh.write("step,name,value\n")
        return self._fh

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        fh = self._open()
        writer = csv.writer(fh)
        for k, v in metrics.items():
            writer.writerow([step, k, repr(float(v))])
        fh.flush()

    def resume(self, step: int) -> None:
        self.finalize()
        _rewrite_keeping(self.path, lambda i, line: i == 0 or int(line.split(",", 1)[0]) <= step)

    def finalize(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class JSONLLogger(Logger):
    """``log_dir/metrics.jsonl``: ``{"step": N, **metrics}`` per call; NaN/inf kept as literals."""

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: Any = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._fh is None:
            self._fh = open(self.path, "a")
        self._fh.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self._fh.flush()

    def resume(self, step: int) -> None:
        self.finalize()
        _rewrite_keeping(self.path, lambda i, line: json.loads(line)["step"] <= step)

    def finalize(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_csv_metrics(path: str | Path) -> list[tuple[int, str, float]]:
    """Rows of a ``metrics.csv`` as (step, name, value)."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))[1:]
    return [(int(s), n, float(v)) for s, n, v in rows]


__all__ = ["CSVLogger", "JSONLLogger", "read_csv_metrics"]

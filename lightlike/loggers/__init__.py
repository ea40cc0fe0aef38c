"""Loggers: CSV/JSONL metrics files, TensorBoard; Python logging; the model summary."""

from __future__ import annotations

import difflib
import importlib.util
import logging
from pathlib import Path
from typing import Any

from lightlike.errors import ConfigError
from lightlike.loggers.base import Logger
from lightlike.loggers.csv import CSVLogger, JSONLLogger

LOGGER_NAMES = ("csv", "jsonl", "tensorboard")
log = logging.getLogger("lightlike")


def _by_name(name: str, log_dir: Path) -> Logger:
    if name == "csv":
        return CSVLogger(log_dir)
    if name == "jsonl":
        return JSONLLogger(log_dir)
    if name == "tensorboard":
        from lightlike.loggers.tensorboard import TensorBoardLogger

        return TensorBoardLogger(log_dir)
    close = difflib.get_close_matches(name, LOGGER_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown logger {name!r}{hint}; valid names: {', '.join(LOGGER_NAMES)}")


def build_loggers(spec: Any, output_dir: str, enabled: bool = True) -> list[Logger]:
    """``'auto'``: CSV, plus TensorBoard when installed; a list of names/instances; [] or None."""
    if not enabled or spec is None:
        return []
    log_dir = Path(output_dir) / "logs"
    if spec == "auto":
        names = ["csv"]
        if importlib.util.find_spec("tensorboard") is not None:
            names.append("tensorboard")
        else:
            log.warning("tensorboard is not installed: logging to CSV only (pip install 'lightlike[tensorboard]')")
        spec = names
    if isinstance(spec, (str, Logger)):
        spec = [spec]
    out = []
    for item in spec:
        if isinstance(item, Logger):
            out.append(item)
        elif isinstance(item, str):
            out.append(_by_name(item, log_dir))
        else:
            raise ConfigError(f"loggers entries must be names ({', '.join(LOGGER_NAMES)}) or Logger instances, "
                              f"got {type(item).__name__}")
    return out


__all__ = ["LOGGER_NAMES", "CSVLogger", "JSONLLogger", "Logger", "build_loggers"]

"""Python logging for lightlike: the chosen level on the main process, WARNING elsewhere."""

from __future__ import annotations

import logging
import sys
from typing import Any

from lightlike.errors import ConfigError

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
FORMAT = "[lightlike %(levelname)s] %(message)s"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (so redirections made
    after set-up, e.g. by test runners or notebooks, are honoured)."""

    _lightlike = True

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(level: str, is_global_zero: bool) -> logging.Logger:
    """Configure the ``lightlike`` logger: one stderr handler (added once, however often this is
    called), ``level`` on the main process and at least WARNING on the others."""
    key = level.strip().lower() if isinstance(level, str) else None
    if key not in LEVELS:
        raise ConfigError(f"log_level={level!r} is not valid; choose one of: {', '.join(LEVELS)}")
    logger = logging.getLogger("lightlike")
    if not any(getattr(h, "_lightlike", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    chosen = LEVELS[key]
    logger.setLevel(chosen if is_global_zero else max(chosen, logging.WARNING))
    return logger


__all__ = ["LEVELS", "setup_logging"]

"""Python logging for lightlike: INFO on the main process, WARNING elsewhere."""

from __future__ import annotations

import logging
import sys

from lightlike.errors import ConfigError

_LEVELS = ("debug", "info", "warning", "error", "critical")


def setup_logging(level: str, is_global_zero: bool) -> logging.Logger:
    """Configure the ``lightlike`` logger once (no duplicate handlers on repeated calls)."""
    if str(level).lower() not in _LEVELS:
        raise ConfigError(f"log_level={level!r} is not valid; choose one of: {', '.join(_LEVELS)}")
    logger = logging.getLogger("lightlike")
    if not any(getattr(h, "_lightlike", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[lightlike %(levelname)s] %(message)s"))
        handler._lightlike = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = True
    logger.setLevel(getattr(logging, level.upper()) if is_global_zero else logging.WARNING)
    return logger

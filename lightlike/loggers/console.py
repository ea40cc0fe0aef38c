"""Python logging for lightlike: ``log_level`` on the main process, ``log_level_other_ranks``
(WARNING by default) on the others."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
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
    #: a progress bar drawn on stderr (``ProgressBar`` sets it while it shows): records are
    #: written above it, not onto its line
    bar: Any = None

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if logging.root.handlers and logging.getLogger("lightlike").propagate:
            return  # the application configured logging after set-up: its handlers print the line
        bar = _StderrHandler.bar
        if bar is None:
            super().emit(record)
            return
        try:
            bar.write(self.format(record), file=self.stream)
        except Exception:  # as StreamHandler.emit does
            self.handleError(record)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _AboveBar:
    """The stream an application's console handler writes to while a progress bar is drawn:
    what the handler formats (its level, filters and formatter stay the application's) is
    written above the bar instead of onto its line."""

    def __init__(self, stream: Any, bar: Any) -> None:
        self.stream, self.bar = stream, bar

    def write(self, text: str) -> None:
        self.bar.write(text.rstrip("\n"), file=self.stream)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def console_lines_above_bar(bar: Any, on_stderr: bool = True) -> Callable[[], None]:
    """Write log lines above ``bar`` (a tqdm bar drawn on stdout or stderr) until the returned
    function is called. lightlike's own stderr handler writes through ``bar.write`` (when the
    bar is ``on_stderr``); the
    console handlers (a ``StreamHandler`` on stdout or stderr) of the root and ``lightlike``
    loggers are pointed at ``bar``'s writer (``setStream``): an application that configured
    logging (``basicConfig``) otherwise printed onto the bar's line. The handlers stay the
    application's own objects: removing one or changing its level during the fit works as
    without a bar (tqdm's ``logging_redirect_tqdm`` swaps them for its own)."""
    if on_stderr:
        _StderrHandler.bar = bar
    swapped: list[tuple[logging.StreamHandler, _AboveBar]] = []  # type: ignore[type-arg]
    for logger in (logging.getLogger(), logging.getLogger("lightlike")):
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and not getattr(h, "_lightlike", False) \
                    and h.stream in (sys.stdout, sys.stderr):
                proxy = _AboveBar(h.stream, bar)
                h.setStream(proxy)
                swapped.append((h, proxy))

    def restore() -> None:
        if _StderrHandler.bar is bar:
            _StderrHandler.bar = None
        for h, proxy in swapped:
            if h.stream is proxy:  # unless the application pointed it elsewhere meanwhile
                h.setStream(proxy.stream)

    return restore


def _level(name: str, value: Any) -> int:
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in LEVELS:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(LEVELS)}")
    return LEVELS[key]


def setup_logging(level: str, is_global_zero: bool, level_other_ranks: str = "warning") -> logging.Logger:
    """Configure the ``lightlike`` logger: one stderr handler (added once, however often this is
    called; none when the application has configured logging, whose handlers then print the
    lines, as Lightning does), ``level`` on the main process and ``level_other_ranks`` on the others (the
    ``log_level`` and ``log_level_other_ranks`` settings)."""
    chosen = _level("log_level", level)
    other = _level("log_level_other_ranks", level_other_ranks)
    logger = logging.getLogger("lightlike")
    ours = [h for h in logger.handlers if getattr(h, "_lightlike", False)]
    if logging.getLogger().hasHandlers():  # the application configured logging: its handlers print
        for h in ours:  # our lines (once: a handler of ours as well printed every line twice)
            logger.removeHandler(h)
    elif not ours:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    logger.setLevel(chosen if is_global_zero else other)
    return logger


__all__ = ["LEVELS", "setup_logging"]

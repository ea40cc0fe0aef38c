"""A tqdm progress bar over optimizer steps, and a second one over each evaluation's batches; off
when the stream is not a terminal (unless forced).

tqdm is a dependency of lightlike, imported in ``on_fit_start`` only when the bar is active
(``import lightlike`` does not load it). While the bar is drawn on stdout or stderr, log lines
(lightlike's and the console handlers of the application's root logger) are written above it. Python's
warnings are left alone: ``warnings.showwarning`` stays the application's (routed through
logging, ``logging.captureWarnings(True)`` with a console handler on the root logger, they go
above the bar too).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from lightlike.callbacks.base import Callback
from lightlike.loggers.console import console_lines_above_bar

if TYPE_CHECKING:
    from lightlike.fitter import Fitter
    from lightlike.state import Control, FitState

log = logging.getLogger("lightlike")
INSTALL_HINT = "pip install tqdm (a dependency of lightlike: the install is incomplete)"
# logged keys shown in the bar's postfix, under a short name, in this order
POSTFIX_KEYS = (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"))


def _fmt(value: Any) -> str:
    """A number in a few characters: 0.1235, 1.5e-05, nan; anything else through str()."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def terminal_shape(stream: Any) -> dict[str, Any]:
    """tqdm's size arguments for ``stream``: the terminal's size, followed as it changes; a fixed
    100 columns and 20 rows where it reports no size (a pseudo-terminal without one, as ``script``,
    ``docker exec -t`` and some CI runners give), where tqdm would read 0 columns and -1 rows and
    draw nothing (a bar past the last row is hidden)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # not a real terminal (a forced bar on a buffer)
        return {"dynamic_ncols": True}
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    return {"dynamic_ncols": False, "ncols": size.columns or 100, "nrows": size.lines or 20}


def _nothing() -> None:
    pass


class ProgressBar(Callback):
    """One bar over optimizer steps. It never reads a tensor: the postfix shows the numbers of
    the last log step, so the bar costs no host-device synchronisation. During an evaluation a
    second bar counts the set's batches (this rank's, out of the loader's length), as the HF
    Trainer and Lightning show one; it is removed when the evaluation ends (its metrics are
    written above the bar), or when the fit ends or fails.

    ``enabled``: True forces the bar, False turns it off, None (default) shows it only when the
    output stream is a terminal. ``file``: the stream (default ``sys.stderr``).
    """

    def __init__(self, enabled: bool | None = None, file: Any = None) -> None:
        self.enabled = enabled
        self.file = file
        self.bar: Any = None
        self.eval_bar: Any = None  # the evaluation's bar, while one runs
        self._eval_name: str | None = None  # the set eval_bar counts
        self._tqdm: Any = None
        self._width: dict[str, Any] = {}
        self._restore_console = _nothing

    @property
    def stream(self) -> Any:
        return self.file if self.file is not None else sys.stderr

    def active(self) -> bool:
        """Whether the bar will show (decided without importing tqdm)."""
        if self.enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            try:
                return bool(isatty()) if callable(isatty) else False
            except (OSError, ValueError):  # closed or detached stream
                return False
        return bool(self.enabled)

    def on_fit_start(self, fitter: Fitter, state: FitState, control: Control) -> None:
        self._close()
        if not self.active():
            return
        try:
            from tqdm import tqdm
        except ImportError as e:
            if self.enabled:
                raise ImportError(f"ProgressBar(enabled=True) needs tqdm: {INSTALL_HINT}") from e
            log.warning("tqdm is not installed: no progress bar (%s)", INSTALL_HINT)
            return
        total = state.max_steps or None
        self._tqdm, self._width = tqdm, terminal_shape(self.stream)
        self.bar = tqdm(total=total, initial=min(state.global_step, total or state.global_step),
                        unit="step", desc="fit", file=self.stream, leave=True, **self._width)
        if self.stream in (sys.stderr, sys.stdout):  # log lines (the application's console handlers too)
            self._restore_console = console_lines_above_bar(self.bar, on_stderr=self.stream is sys.stderr)

    def on_step_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            shown = {short: _fmt(metrics[key]) for key, short in POSTFIX_KEYS if key in metrics}
            if shown:
                self.bar.set_postfix(shown, refresh=False)  # drawn at the next refresh/close

    def on_eval_batch_end(self, fitter: Fitter, state: FitState, control: Control, name: str, batch: int,
                          num_batches: int | None) -> None:
        if self.bar is None:
            return
        if self.eval_bar is None or name != self._eval_name:  # the first batch of a set
            self._close_eval()
            self.eval_bar = self._tqdm(total=num_batches, unit="batch", desc=f"evaluate {name}", file=self.stream,
                                       leave=False, **self._width)
            self._eval_name = name
        self.eval_bar.update(1)
        if num_batches is not None and batch + 1 == num_batches:
            self.eval_bar.refresh()  # drawn complete once (tqdm redraws at most every 0.1 s)

    def on_evaluate(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None:
        self._close_eval()
        if self.bar is not None:
            text = "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            self.bar.write(f"step {state.global_step}: {text}", file=self.stream)

    def _close_eval(self) -> None:
        if self.eval_bar is not None:
            try:
                self.eval_bar.close()  # leave=False: its line is cleared
            finally:
                self.eval_bar, self._eval_name = None, None

    def _close(self) -> None:
        self._close_eval()
        if self.bar is not None:
            self._restore_console()
            self._restore_console = _nothing
            try:
                self.bar.close()
            finally:
                self.bar = None

    def on_fit_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        self._close()

    def on_exception(self, fitter: Fitter, state: FitState, control: Control, error: BaseException) -> None:
        self._close()


__all__ = ["ProgressBar"]

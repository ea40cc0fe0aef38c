"""BF mutation round: lines written above a progress bar drawn on stderr (a pipe, bar forced)."""
from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

from lightlike.callbacks.progress import ProgressBar

TESTS = str(Path(__file__).parents[1])


def _fit_with_a_forced_bar(tmp_path, prelude: str, on_first_step: str) -> str:
    """stderr (bytes decoded, \r kept) of a fit drawing a forced bar on stderr (a pipe)."""
    code = f"""
import logging, sys, warnings
sys.path.insert(0, {TESTS!r})
import lightlike as ll
from lightlike.callbacks.progress import ProgressBar
from helpers import Classifier, DictDataset
{prelude}
class Say(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 1:
{on_first_step}

ll.Fitter(max_steps=2, batch_size=4, output_dir={str(tmp_path / "o")!r}, loggers=[], progress_bar=False,
          save_strategy="no", model_summary=False,
          callbacks=[ProgressBar(enabled=True), Say()]).fit(Classifier(), DictDataset(n=8))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)  # bytes: keep \r
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 0, err[-2000:]
    assert "2/2" in err
    return err


def test_application_lines_go_above_a_forced_bar_and_warnings_are_left_alone(tmp_path):
    err = _fit_with_a_forced_bar(
        tmp_path, 'logging.basicConfig(level=logging.INFO, format="APP %(message)s", stream=sys.stderr)\n'
                  'ORIGINAL = warnings.showwarning',
        '            logging.getLogger("app").info("first line")\n'
        '            logging.getLogger("app").info("second line")\n'
        '            assert warnings.showwarning is ORIGINAL, "the bar patched warnings.showwarning"\n'
        '            warnings.warn("a warning", UserWarning)')
    # each record on a line of its own, at the start of the line, and no blank line after it
    for text in ("APP first line", "APP second line"):
        assert re.search(rf"(^|[\r\n]){text}\n[^\n]", err), err[-1500:]
    assert "UserWarning: a warning" in err  # printed by Python's own showwarning, where it prints


def test_lightlike_lines_go_above_a_forced_bar(tmp_path):
    err = _fit_with_a_forced_bar(tmp_path, "", '            logging.getLogger("lightlike").warning("our line")')
    assert re.search(r"(^|[\r\n])\[lightlike WARNING\] our line\n[^\n]", err), err[-1500:]


def test_a_closed_stream_shows_no_bar():
    buf = io.StringIO()
    buf.close()
    assert not ProgressBar(file=buf).active()


class _StubBar:
    def __init__(self):
        self.lines = []

    def write(self, text, file=None):
        self.lines.append(text)


def test_handlers_of_the_lightlike_logger_write_above_the_bar_too():
    import logging

    from lightlike.loggers.console import console_lines_above_bar

    lg = logging.getLogger("lightlike")
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(message)s"))
    lg.addHandler(h)
    bar = _StubBar()
    try:
        restore = console_lines_above_bar(bar)
        h.handle(logging.makeLogRecord({"name": "lightlike", "msg": "hello", "levelno": logging.INFO}))
        restore()
        assert bar.lines == ["hello"]
        assert h.stream is sys.stderr
    finally:
        lg.removeHandler(h)


def test_restore_leaves_a_handler_the_application_repointed():
    import logging

    from lightlike.loggers.console import console_lines_above_bar

    root = logging.getLogger()
    h = logging.StreamHandler(sys.stderr)
    root.addHandler(h)
    try:
        restore = console_lines_above_bar(_StubBar())
        elsewhere = io.StringIO()
        h.setStream(elsewhere)  # the application's choice during the fit
        restore()
        assert h.stream is elsewhere
    finally:
        root.removeHandler(h)

"""BF mutation round: lines written above a progress bar drawn on stderr (a pipe, bar forced)."""
from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

from lightlike.callbacks.progress import ProgressBar

TESTS = str(Path(__file__).parent)


def test_application_lines_and_explicit_stderr_warnings_go_above_a_forced_bar(tmp_path):
    code = f"""
import logging, sys, warnings
sys.path.insert(0, {TESTS!r})
import lightlike as ll
from lightlike.callbacks.progress import ProgressBar
from helpers import Classifier, DictDataset
logging.basicConfig(level=logging.INFO, format="APP %(message)s", stream=sys.stderr)

class Say(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 1:
            logging.getLogger("app").info("first line")
            logging.getLogger("app").info("second line")
            warnings.showwarning(UserWarning("direct to stderr"), UserWarning, "x.py", 7, file=sys.stderr)

ll.Fitter(max_steps=2, batch_size=4, output_dir={str(tmp_path / "o")!r}, loggers=[], progress_bar=False,
          save_strategy="no", model_summary=False,
          callbacks=[ProgressBar(enabled=True), Say()]).fit(Classifier(), DictDataset(n=8))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)  # bytes: keep \r
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 0, err[-2000:]
    # each record on a line of its own, at the start of the line, and no blank line after it
    for text in ("APP first line", "APP second line"):
        assert re.search(rf"(^|[\r\n]){text}\n[^\n]", err), err[-1500:]
    # an explicit file=sys.stderr warning is written above the bar too: at the start of a line
    assert re.search(r"(^|[\r\n])x\.py:7: UserWarning: direct to stderr", err), err[-1500:]
    assert "2/2" in err


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

"""BF mutation round: the progress bar's postfix and when it shows, read from tqdm's real output."""
from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.callbacks.progress import ProgressBar
from lightlike.state import Control, FitState


def test_bar_postfix_shows_loss_lr_and_grad_norm_of_a_real_fit(tmp_path):
    buf = io.StringIO()
    rows = []

    class Rows(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            rows.append(dict(metrics))

    torch.manual_seed(0)
    ll.Fitter(max_steps=4, batch_size=4, log_every=2, max_grad_norm=1.0, lr_scheduler="constant", learning_rate=0.01,
              output_dir=str(tmp_path), loggers=[], model_summary=False, save_strategy="no", progress_bar=False,
              callbacks=[ProgressBar(enabled=True, file=buf), Rows()]).fit(Classifier(), DictDataset(n=16))
    last = rows[-1]
    text = buf.getvalue()
    final = text.replace("\r", "\n").strip().splitlines()[-1]
    # tqdm's own rendering of the postfix: "name=value" pairs in this order, 4 significant digits
    expected = f"loss={last['train/loss']:.4g}, lr=0.01, grad_norm={last['train/grad_norm']:.4g}"
    assert expected in final, final
    assert "4/4" in final


def test_bar_postfix_keeps_order_and_formats_grad_norm():
    buf = io.StringIO()
    bar = ProgressBar(enabled=True, file=buf)
    state, control = FitState(max_steps=2), Control()
    bar.on_fit_start(SimpleNamespace(), state, control)
    state.global_step = 2
    bar.on_step_end(SimpleNamespace(), state, control)
    bar.on_step_end(SimpleNamespace(), state, control)
    bar.on_log(SimpleNamespace(), state, control,
               {"train/grad_norm": 123456.0, "train/loss": 0.5, "train/lr": 3e-4, "train/epoch": 0.5})
    bar.on_fit_end(SimpleNamespace(), state, control)
    final = buf.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert final.endswith("loss=0.5, lr=0.0003, grad_norm=1.235e+05]"), final


def test_bar_off_on_a_stream_without_isatty():
    class WriteOnly:  # a file-like object with no isatty: not a terminal
        def __init__(self):
            self.parts = []

        def write(self, s):
            self.parts.append(s)

        def flush(self):
            pass

    class NotCallable(WriteOnly):
        isatty = True  # an attribute, not the method

    for cls in (WriteOnly, NotCallable):
        stream = cls()
        bar = ProgressBar(file=stream)
        assert not bar.active()
        state, control = FitState(max_steps=2), Control()
        bar.on_fit_start(SimpleNamespace(), state, control)
        bar.on_step_end(SimpleNamespace(), state, control)
        bar.on_fit_end(SimpleNamespace(), state, control)
        assert stream.parts == [] and bar.bar is None


def test_a_bar_on_stdout_leaves_warnings_and_log_lines_on_stderr(tmp_path):
    import subprocess

    code = f"""
import sys, warnings
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import lightlike as ll
from lightlike.callbacks.progress import ProgressBar
from helpers import Classifier, DictDataset

class Warn(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 1:
            warnings.warn("BF-WARNING", UserWarning)

ll.Fitter(max_steps=2, batch_size=4, log_every=1, output_dir={str(tmp_path / "o")!r}, loggers=[], progress_bar=False,
          save_strategy="no", model_summary=False,
          callbacks=[ProgressBar(enabled=True, file=sys.stdout), Warn()]).fit(Classifier(), DictDataset(n=8))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fit: 100%" in p.stdout and "2/2" in p.stdout
    assert "UserWarning: BF-WARNING" in p.stderr and "BF-WARNING" not in p.stdout, (p.stdout, p.stderr)


def test_bar_on_a_terminal_without_a_size_is_100_columns_wide():
    """A pseudo-terminal that reports 0 columns: the bar is drawn 100 wide (tqdm's own width
    there is a 10-character meter)."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import subprocess
    import termios

    code = ("import sys\nfrom types import SimpleNamespace as NS\nfrom lightlike.callbacks.progress import ProgressBar\n"
            "from lightlike.state import FitState, Control\n"
            "s, c = FitState(max_steps=4), Control()\nb = ProgressBar()\nassert b.active()\n"
            "b.on_fit_start(NS(), s, c)\nfor _ in range(4):\n    b.on_step_end(NS(), s, c)\nb.on_fit_end(NS(), s, c)\n")
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 0, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=60) == 0, b"".join(chunks)
    text = b"".join(chunks).decode(errors="replace")
    lines = [x for x in re.split(r"[\r\n]+", text) if "4/4" in x]
    assert lines and len(lines[-1].rstrip()) == 100, lines

"""The progress bar on a real pseudo-terminal, read back from its master side: one that reports
no size (``script``, ``docker exec -t``, some CI runners) gets a bar of 100 columns (tqdm drew
nothing there), one with a size gets a bar as wide as it is."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIT = """
import sys
sys.path.insert(0, {tests!r})
from helpers import Classifier, DictDataset
import lightlike as ll
ll.Fitter(max_steps=5, batch_size=4, loggers=[], model_summary=False, save_strategy="no", eval_every=5,
          output_dir={out!r}).fit(Classifier(), DictDataset(32), DictDataset(8))
print("fit returned")
"""


def on_a_pty(tmp_path, rows: int, columns: int) -> str:
    """What a short fit writes to a pseudo-terminal of ``rows`` x ``columns`` (0 x 0: no size)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    code = FIT.format(tests=str(ROOT / "tests"), out=str(tmp_path / "out"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    received = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the slave side
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0, received.decode(errors="replace")
    return received.decode()


@pytest.mark.parametrize(("rows", "columns", "width"), [(0, 0, 100), (24, 72, 72)])
def test_the_bar_is_drawn_on_a_pty(tmp_path, rows, columns, width):
    text = on_a_pty(tmp_path, rows, columns)
    assert "fit returned" in text
    frames = [f for f in re.split(r"[\r\n]+", text) if f.startswith("fit:")]
    assert frames and "5/5" in frames[-1] and "loss=" in frames[-1], text
    assert all(len(f) <= width for f in frames) and len(frames[-1]) >= width - 1  # (tqdm keeps off the last column)
    assert "evaluate val:" in text, text  # the evaluation's bar too

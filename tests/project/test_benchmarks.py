"""The checkpoint benchmark runs end to end on a tiny model (its figures are not checked: no
wall-clock thresholds in tests). It guards the script, and the verification in its hand-written
baseline, against rotting between the sessions that record its figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_benchmark_runs_and_cleans_up(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint.py"), "--width", "32", "--layers", "2",
         "--repeats", "1", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for line in ("save: lightlike", "raw + fsync, the same durability", "save, async_save=True",
                 "raw + CRC-32 by hand, the same checks", "time to first step after resume"):
        assert line in out, out
    if hasattr(os, "posix_fadvise"):
        assert "load from disk:" in out, out
    assert list(tmp_path.iterdir()) == []  # every checkpoint and raw file it wrote is gone

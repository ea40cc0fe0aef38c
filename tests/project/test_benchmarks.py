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
                 "raw + XXH3 by hand, the same checks", "time to first step after resume"):
        assert line in out, out
    if hasattr(os, "posix_fadvise"):
        assert "load from disk:" in out, out
    assert list(tmp_path.iterdir()) == []  # every checkpoint and raw file it wrote is gone


def test_gpt_peers_benchmark_tiny_runs_and_skips_a_missing_peer_with_a_note() -> None:
    """``gpt_peers.py --tiny`` on the CPU: a row for the hand-written loop and lightlike, and for
    each of Lightning and the HF Trainer a row where installed, else a note (never a failure)."""
    import importlib.util

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpt_peers.py"), "--tiny", "--steps", "4",
                           "--warmup", "2"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| hand | " in out and "| lightlike | " in out, out
    for driver, modules in (("lightning", ("lightning", "pytorch_lightning")), ("hf", ("transformers", "accelerate"))):
        if driver == "lightning":
            installed = any(importlib.util.find_spec(m) is not None for m in modules)
        else:
            installed = all(importlib.util.find_spec(m) is not None for m in modules)
        assert (f"| {driver} | " in out) is installed, out
        assert (f"note: {driver} is not installed here: skipped" in out) is not installed, out

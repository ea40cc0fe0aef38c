"""Two builds' per-step overhead side by side: ``overhead.py``'s hand loop (same work) and Fitter,
measured in alternating processes, one process per build per round.

On a shared VM the clock drifts by several per cent within minutes, so two builds measured one
after the other can swap places. Here each round runs one process of build A, then one of build
B; each process times the hand loop and the Fitter twice (2000 steps each, clocks from step 100)
and reports its minimum of each, so drift hits both builds alike. A build is a directory holding
a checkout of the repository (``git worktree add /tmp/old <commit>``); each process imports
lightlike from its own directory.

    git worktree add /tmp/old HEAD~3
    python benchmarks/overhead_ab.py /tmp/old . --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import argparse, json, sys, torch
sys.path.insert(0, "benchmarks")
from overhead import Data, hand_written, model_arguments, with_fitter
p = argparse.ArgumentParser(); model_arguments(p); a = p.parse_args([]); a.steps, a.warmup = 2000, 100
torch.set_num_threads(1); d = Data(a.samples, a.features)
short = argparse.Namespace(**{**vars(a), "steps": 200, "warmup": 100})
with_fitter(d, short); hand_written(d, short, norm="foreach", window=True)
h, f = [], []
for _ in range(2):
    h.append(hand_written(d, a, norm="foreach", window=True)); f.append(with_fitter(d, a))
print(json.dumps([min(h), min(f)]))
"""


def measure(build: Path) -> tuple[float, float]:
    """(hand, Fitter) seconds per step, each the minimum of two runs in one process of ``build``."""
    env = {**os.environ, "PYTHONPATH": str(build)}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=build, env=env, capture_output=True, text=True,
                         check=True)
    hand, fitter = json.loads(out.stdout.strip().splitlines()[-1])
    return hand, fitter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("builds", nargs=2, type=Path, help="two checkouts of the repository")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    builds = [b.resolve() for b in args.builds]
    runs: dict[Path, list[tuple[float, float]]] = {b: [] for b in builds}
    for _ in range(args.rounds):
        for b in builds:
            runs[b].append(measure(b))
    for b, r in runs.items():
        hand, fitter = min(h for h, _ in r), min(f for _, f in r)
        ratios = [f / h for h, f in r]
        print(f"{str(b):30} hand {hand * 1e6:6.1f}  Fitter {fitter * 1e6:6.1f} us/step  "
              f"Fitter / same work {fitter / hand:.3f} (min)  {statistics.median(ratios):.3f} (median of rounds)")


if __name__ == "__main__":
    main()

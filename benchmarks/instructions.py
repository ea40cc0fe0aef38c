"""Instructions per step under valgrind's callgrind: the Fitter against the hand-written loops.

The wall clock of a shared 2-core VM swings by ±30 % while other work runs; the instructions a
loop executes do not. Each loop of ``benchmarks/overhead.py`` runs in its own process under
``valgrind --tool=callgrind`` with counting off until step ``--warmup`` and off again after the
last step (a small C helper issues callgrind's client requests through ctypes), so imports,
set-up and the end of the fit are left out. The count repeats to the instruction on a loaded
machine, and its ratios agreed with the quietest wall-clock rounds of ``overhead.py`` to about
2 % on this VM (1.202 here against 1.18-1.24 there, before this session's cuts). It is not a
time: instructions waiting on memory cost more than others. Needs valgrind (with its headers)
and a C compiler; each loop takes about 2 minutes (the loops run in parallel, ``--jobs``).

    python benchmarks/instructions.py                    # 200 counted steps of each loop
    python benchmarks/instructions.py --steps 500 --loops fitter hand-norm
    python benchmarks/instructions.py --loops hand-norm fitter fabric-norm   # with lightning installed
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HELPER = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT("window"); }
"""

LOOPS = {  # name: (what runs, the hand loop's gradient-norm variant)
    "hand-norm": "hand loop, same work (gradient norm, window-mean loss)",
    "hand": "hand loop without the norm",
    "fitter": "lightlike Fitter, defaults",
    "fabric-norm": "Lightning Fabric, same work (needs lightning)",
}


def child(loop: str, steps: int, warmup: int, library: str) -> None:
    """Run one loop with the counting window around steps warmup+1..steps."""
    import ctypes

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overhead import Data, hand_written, with_fitter

    lib = ctypes.CDLL(library)
    mark = {"start": lib.cg_start, "stop": lib.cg_stop}
    torch.set_num_threads(1)
    args = argparse.Namespace(features=32, width=32, batch_size=16, samples=4096, device="cpu", steps=steps,
                              warmup=warmup)
    data = Data(args.samples, args.features)
    if loop == "fitter":
        with_fitter(data, args, mark=lambda what: mark[what]())
    else:
        same = loop in ("hand-norm", "fabric-norm")
        hand_written(data, args, mark=lambda what: mark[what](), norm="foreach" if same else "none", window=same,
                     fabric=loop == "fabric-norm")


def count(loop: str, steps: int, warmup: int, library: str, work: Path) -> float:
    out = work / f"callgrind.{loop}"
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--instr-atstart=no",
           f"--callgrind-out-file={out}", sys.executable, __file__, "--child", loop,
           "--steps", str(steps), "--warmup", str(warmup), "--library", library]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONHASHSEED": "0"})
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode or not found:
        raise SystemExit(f"{loop}: valgrind failed (rc {run.returncode}):\n{run.stderr[-2000:]}")
    return int(found.group(1)) / (steps - warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--loops", nargs="+", default=["hand-norm", "hand", "fitter"], choices=list(LOOPS))
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--library", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup, args.library)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "helper.c").write_text(HELPER)
        library = str(work / "libcallgrind_window.so")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", library, str(work / "helper.c")], check=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            counts = dict(zip(args.loops, pool.map(lambda loop: count(loop, args.steps, args.warmup, library, work),
                                                   args.loops), strict=True))
    print(f"instructions per step, steps {args.warmup + 1}..{args.steps} (tiny MLP, CPU, one thread)")
    for loop, n in counts.items():
        print(f"{LOOPS[loop]:60}: {n:12,.0f}")
    if "fitter" in counts:
        for base in ("hand-norm", "hand", "fabric-norm"):
            if base in counts:
                print(f"fitter / {base:10}: {counts['fitter'] / counts[base]:.3f}")


if __name__ == "__main__":
    main()

"""Hardware counters per step: the Fitter against the hand-written loop, under Linux ``perf stat``.

The loops are ``benchmarks/overhead.py``'s (tiny MLP, the Fitter's defaults, the hand loop doing
the same work). On a shared VM their wall-clock ratio drifts by several per cent between runs;
instructions retired per step repeat to about 0.2 % and user-mode cycles to about 3 %, so a
change to the step that saves a few microseconds shows here when the clock cannot see it.
Instructions count the work done; cycles also count what the work waits for (cache misses,
branch mispredictions), so the two ratios differ.

Each loop runs in its own process under ``perf stat --control``: counting is off until step
``--warmup`` and stops at the last step, so imports, setup and the end of the fit are left out.
Needs ``perf`` with user-mode counters (``/proc/sys/kernel/perf_event_paranoid`` at most 2).

    python benchmarks/counters.py                  # 4000 counted steps, 2 runs of each loop
    python benchmarks/counters.py --ddp --width 256 --steps 1300   # benchmarks/ddp.py's loops

With ``--ddp`` the loops are ``benchmarks/ddp.py``'s (DDP, gloo, 2 processes under torchrun) and
perf counts every process and thread of the launch (both ranks, gloo's threads, the torchrun
agent) from rank 0's counted steps' start to their end; ranks move in step, so the difference
per step between the two loops is the Fitter's. Gloo polls while a rank waits, so here (2 cores
for 2 ranks and their threads) even instructions vary by several per cent between runs of the
same build: a bound, not the 0.2 % of the one-process figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import model_arguments  # noqa: E402

EVENTS = ("instructions:u", "cycles:u")


def child(args: argparse.Namespace) -> None:
    """One loop, writing enable/disable to perf's control FIFO around the counted steps."""
    import torch
    from overhead import Data, hand_written, with_fitter

    torch.set_num_threads(1)
    data = Data(args.samples, args.features)

    def mark(what: str) -> None:
        with open(args.control, "w") as fifo:
            fifo.write("enable\n" if what == "start" else "disable\n")

    if args.ddp:
        import ddp
        import torch.distributed as dist

        ddp.with_fitter(data, argparse.Namespace(**{**vars(args), "steps": 150, "warmup": 50}))  # sets up the group
        dist.barrier()
        loop = ddp.hand_written if args.child == "hand" else ddp.with_fitter
        loop(data, args, mark=mark if dist.get_rank() == 0 else None)
        return
    loop = hand_written if args.child == "hand" else with_fitter
    loop(data, args, mark=mark)


def count(which: str, args: argparse.Namespace) -> dict[str, float]:
    """Per-step counts of EVENTS for one run of ``which``."""
    with tempfile.TemporaryDirectory() as tmp:
        control = os.path.join(tmp, "control")
        os.mkfifo(control)
        launch = [sys.executable]
        if args.ddp:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            launch += ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
        cmd = ["perf", "stat", "-x,", "-D", "-1", "--control", f"fifo:{control}", "-e", ",".join(EVENTS), "--",
               *launch, os.path.abspath(__file__), "--child", which, "--control", control,
               *(["--ddp"] if args.ddp else []),
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("steps", "warmup", "width", "features", "batch_size", "samples"))]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        sys.exit(f"{which} loop failed under perf (exit {run.returncode}):\n{run.stderr[-2000:]}")
    out: dict[str, float] = {}
    for line in run.stderr.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2] in EVENTS:
            if not fields[0].isdigit():
                sys.exit(f"perf could not count {fields[2]} ({fields[0]}): user-mode counters are not "
                         "available here (check /proc/sys/kernel/perf_event_paranoid)")
            out[fields[2]] = int(fields[0]) / (args.steps - args.warmup)
    if set(out) != set(EVENTS):
        sys.exit(f"perf printed no counts for {sorted(set(EVENTS) - set(out))}:\n{run.stderr[-2000:]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--steps", type=int, default=4300, help="last step; counting covers warmup+1..steps")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ddp", action="store_true", help="benchmarks/ddp.py's loops on 2 processes (gloo)")
    p.add_argument("--child", choices=("hand", "fitter"), help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if shutil.which("perf") is None:
        sys.exit("benchmarks/counters.py needs Linux `perf` (linux-tools); it is not on PATH")
    runs: dict[str, list[dict[str, float]]] = {"hand": [], "fitter": []}
    for _ in range(args.repeats):
        for which in runs:  # alternate, as overhead.py does
            runs[which].append(count(which, args))
    print(f"{'DDP, 2 processes, all threads counted; ' if args.ddp else ''}"
          f"width {args.width}, batch {args.batch_size}, steps {args.warmup + 1}..{args.steps} counted, "
          f"{args.repeats} runs of each loop (medians)")
    for event in EVENTS:
        hand = statistics.median(r[event] for r in runs["hand"])
        fit = statistics.median(r[event] for r in runs["fitter"])
        print(f"{event:16} hand {hand:12,.0f}/step  fitter {fit:12,.0f}/step  ratio {fit / hand:.3f}  "
              f"({fit - hand:+,.0f})")


if __name__ == "__main__":
    main()

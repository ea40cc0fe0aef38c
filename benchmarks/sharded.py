"""Per-step time and per-rank memory of the sharded strategies against DDP, 2 processes (gloo, CPU).

Every strategy trains the same model through the same Fitter settings (a stack of 4 residual MLP
blocks, AdamW, batch 16 per rank); only ``strategy=`` changes. Reported per strategy: median
steady-state per-step time and its ratio to DDP, and the bytes of parameters + gradients +
optimizer state that each rank holds (its local shards, read from ``lightlike.utils.memory.memory_footprint``
just before an optimizer step) and their ratio to DDP's. Strategies whose extra is not installed
(DeepSpeed) are reported as skipped.

    python benchmarks/sharded.py                       # launches itself with torchrun, 2 processes
    python benchmarks/sharded.py --strategies ddp,fsdp --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from overhead import Clock, Data  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.utils.memory import memory_footprint  # noqa: E402

DEFAULT = "ddp,fsdp,deepspeed_zero1,deepspeed_zero2,deepspeed_zero3"


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(ll.TaskModule):
    def __init__(self, features: int, width: int, depth: int = 4, classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, classes)

    def forward(self, batch):
        h = self.inp(batch["x"])
        for b in self.blocks:
            h = b(h)
        return self.out(h)

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])


class Footprint(ll.Callback):
    def __init__(self, at: int):
        self.at, self.bytes = at, None

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        if state.global_step + 1 == self.at:
            self.bytes = memory_footprint(fitter.strategy, fitter.model, fitter.optimizer)


def run(strategy: str, data: Data, args: argparse.Namespace) -> tuple[float, dict[str, int]]:
    torch.manual_seed(0)
    clock, footprint = Clock(args.warmup, args.steps), Footprint(args.warmup)
    with tempfile.TemporaryDirectory() as out:
        ll.Fitter(strategy=strategy, max_steps=args.steps, batch_size=args.batch_size, learning_rate=1e-3,
                  output_dir=out, seed=0, log_level="warning", loggers=[], progress_bar=False,
                  callbacks=[clock, footprint]).fit(Stack(args.features, args.width), data)
    return (clock.t1 - clock.t0) / (args.steps - args.warmup), footprint.bytes


def available(name: str) -> bool:
    if name.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401

            from lightlike.strategies import deepspeed as _  # noqa: F401
        except ImportError:
            return False
    return True


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    data = Data(args.samples, args.features)
    names = [n for n in args.strategies.split(",") if available(n)]
    skipped = [n for n in args.strategies.split(",") if n not in names]
    times: dict[str, list[float]] = {n: [] for n in names}
    memory: dict[str, dict[str, int]] = {}
    for name in names:  # warm-up (the first also starts the process group)
        run(name, data, argparse.Namespace(**{**vars(args), "steps": 12, "warmup": 4}))
    for _ in range(args.repeats):
        for name in names:  # alternate, so slow phases of the machine hit every strategy
            dist.barrier()
            t, fp = run(name, data, args)
            times[name].append(t)
            memory[name] = fp
    if dist.get_rank() != 0:
        return
    base_t = statistics.median(times["ddp"]) if "ddp" in times else None
    base_m = sum(memory["ddp"].values()) if "ddp" in memory else None
    print(f"2 processes (gloo, CPU, 1 thread each); 4 blocks of width {args.width} "
          f"({sum(p.numel() for p in Stack(args.features, args.width).parameters()) / 1e6:.2f} M parameters), "
          f"batch {args.batch_size}/rank, {args.steps} steps x {args.repeats}")
    print(f"{'strategy':18} {'us/step':>9} {'vs ddp':>7} {'params+grads+optim bytes/rank':>30} {'vs ddp':>7}")
    rows = {}
    for name in names:
        t, m = statistics.median(times[name]), sum(memory[name].values())
        rt = f"{t / base_t:.2f}" if base_t else "-"
        rm = f"{m / base_m:.3f}" if base_m else "-"
        print(f"{name:18} {t * 1e6:9.0f} {rt:>7} {m:>30,} {rm:>7}   runs {', '.join(f'{x * 1e6:.0f}' for x in times[name])}")
        rows[name] = {"us_per_step": t * 1e6, "bytes_per_rank": memory[name], "runs_us": [x * 1e6 for x in times[name]]}
    for name in skipped:
        print(f"{name:18} skipped (not installed)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=DEFAULT)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    worker(args)


if __name__ == "__main__":
    main()

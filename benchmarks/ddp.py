"""Per-step time of the Fitter with DDP against a hand-written DDP loop, 2 processes (gloo, CPU).

Both loops: DistributedDataParallel over the same MLP, the AdamW the Fitter builds by default
(fused kernel, no weight decay), a linear schedule, each rank
reading its half of a shuffled order, one thread per process. The Fitter adds what makes it
exact: one all-reduce of the step's item count (skipped when lightlike's sampler deals equal
counts, as here). Runs alternate; medians of steady-state per-step time (clock from step
``--warmup`` on) are compared, and so are the best runs: two processes and gloo's threads on a
two-core machine disturb single runs by +-15 %, and disturbance only ever adds time.

    python benchmarks/ddp.py                # launches itself with torchrun --nproc_per_node 2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
from overhead import MLP, Clock, Data  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.data.sampler import ResumableSampler  # noqa: E402


def hand_written(data: Data, args: argparse.Namespace, mark=None) -> tuple[float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP(args.features, args.width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / args.steps))
    sampler = ResumableSampler(len(data), seed=0, rank=rank, world_size=world, even=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    step, epoch, t0, cpu0 = 0, 0, 0.0, 0.0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model.module.loss(model(batch), batch)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == args.warmup:
                t0, cpu0 = time.perf_counter(), time.thread_time()
                if mark:
                    mark("start")
            if step % 100 == 0:
                loss.item()
            if step == args.steps:
                if mark:
                    mark("stop")
                break
        epoch += 1
    n = args.steps - args.warmup
    return (time.perf_counter() - t0) / n, (time.thread_time() - cpu0) / n


def with_fitter(data: Data, args: argparse.Namespace, mark=None) -> tuple[float, float]:
    torch.manual_seed(0)
    clock = Clock(args.warmup, args.steps, mark)
    with tempfile.TemporaryDirectory() as out:
        ll.Fitter(strategy="ddp", max_steps=args.steps, batch_size=args.batch_size, learning_rate=1e-3,
                  output_dir=out, seed=0, log_level="warning", callbacks=[clock]).fit(MLP(args.features, args.width), data)
    n = args.steps - args.warmup
    return (clock.t1 - clock.t0) / n, (clock.cpu1 - clock.cpu0) / n


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    data = Data(args.samples, args.features)
    with_fitter(data, argparse.Namespace(**{**vars(args), "steps": 150, "warmup": 50}))  # sets up the group
    hand, fit = [], []
    for _ in range(args.repeats):
        dist.barrier()
        hand.append(hand_written(data, args))
        dist.barrier()
        fit.append(with_fitter(data, args))
    cpu = torch.tensor([statistics.median(c for _, c in hand), statistics.median(c for _, c in fit)], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)  # the busier rank (rank 0 logs)
    if dist.get_rank() == 0:
        wall_h, wall_f = [w for w, _ in hand], [w for w, _ in fit]
        h, f = statistics.median(wall_h), statistics.median(wall_f)
        hb, fb = min(wall_h), min(wall_f)
        print(f"2 processes (gloo, CPU, 1 thread each), width {args.width}, batch {args.batch_size}/rank, "
              f"{args.steps} steps x {args.repeats}")
        print(f"hand-written DDP loop : {h * 1e6:8.1f} us/step  (runs: {', '.join(f'{x * 1e6:.0f}' for x in wall_h)})")
        print(f"lightlike Fitter DDP  : {f * 1e6:8.1f} us/step  (runs: {', '.join(f'{x * 1e6:.0f}' for x in wall_f)})")
        print(f"ratio fitter/hand     : {f / h:.3f} (medians), {fb / hb:.3f} (best runs: the least disturbed of each)")
        print(f"main-thread CPU time  : hand {cpu[0] * 1e6:.1f} us/step, fitter {cpu[1] * 1e6:.1f} us/step, "
              f"ratio {cpu[1] / cpu[0]:.3f} (the work each loop does, waits excluded)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
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

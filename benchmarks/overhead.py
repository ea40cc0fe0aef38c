"""Per-step overhead of the Fitter against a hand-written PyTorch loop, on a tiny MLP.

A tiny model is the worst case for a framework: the step itself costs little, so everything the
framework adds shows. The Fitter runs with its default settings (fused AdamW without weight
decay, a linear schedule, loss read and logged every ``log_every`` steps to CSV and TensorBoard,
no progress bar when not a TTY). Two hand-written loops run beside it:

- the **same work** (the overhead figure): the optimizer the Fitter builds by default
  (``AdamW(fused=True, weight_decay=0)``), a linear schedule, shuffled batches, one thread, and
  the global gradient norm of every step, which the Fitter's defaults take (it is checked for
  NaN/inf and logged as ``train/grad_norm``, as the HF Trainer logs ``grad_norm``), with the
  same arithmetic (one ``_foreach_norm``, the norm of the norms) over a parameter list built
  once; and the logged loss the mean of the 100 steps since the last log, as the Fitter
  (``log_every=100``) and the HF Trainer log it (each step's loss detached and kept, read at
  once). The loop without either (``no norm``: the last step's loss read every 50 steps) is
  timed too: the ratio against it is what the norm, the window mean and the loop together cost;
- a **typical** hand loop, ``torch.optim.AdamW(model.parameters(), lr=...)`` with torch's
  defaults (weight decay 0.01, no fused kernel on the CPU): what the Fitter's defaults are
  compared with by someone who does not pick the optimizer's kernel.

Both clocks run from step ``--warmup`` to the last step, so one-time costs (imports on the first
log, the first TensorBoard write) are left out of both. Runs alternate (hand, fitter, hand,
fitter, ...) so that drift of the machine hits both; the figures reported are the ratios of the
minimum (the target's measure: the quietest round of each) and of the median per-step times.
Instruction counts (callgrind, ``benchmarks/instructions.py``) repeat exactly on a loaded machine.

    python benchmarks/overhead.py                 # defaults: width 32, batch 16, 2000 steps x 5
    python benchmarks/overhead.py --width 256 --steps 1000
    python benchmarks/overhead.py --device cuda   # on a GPU: both loops there, the clocks synchronised
    python benchmarks/overhead.py --fabric        # and the same-work loop through Lightning Fabric
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightlike as ll


class Data(Dataset):
    def __init__(self, n: int, features: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class MLP(ll.TaskModule):
    def __init__(self, features: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, 4))

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])


def hand_written(data: Data, args: argparse.Namespace, same_work: bool = True, mark=None, norm: str = "none",
                 window: bool = False, fabric: bool = False) -> float:
    """Seconds per step over steps warmup+1..steps; ``mark('start'/'stop')`` at those points
    (benchmarks/counters.py counts hardware events between them). ``norm``: the global gradient
    norm every step, as the Fitter's defaults take it (logged as ``train/grad_norm``, checked for
    NaN/inf): "torch" with ``torch.nn.utils.get_total_norm``, "foreach" with the arithmetic the
    Fitter uses on one device, "none" not at all. ``window``: log the mean loss of the 100 steps
    since the last log, as the Fitter (``log_every=100``) and the HF Trainer do (each step's
    loss detached and kept, read at once at the log step); else the last step's loss every 50."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = MLP(args.features, args.width).to(device)
    if same_work:  # what the Fitter's defaults build
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    else:  # torch's defaults
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / args.steps))
    backward, loss_of = torch.Tensor.backward, model.loss  # (the module's own loss: no wrapper attribute lookup)
    if fabric:  # imported here only: the package never imports Lightning
        from lightning.fabric import Fabric

        runner = Fabric(accelerator=device.type, devices=1, precision="32-true")
        model, opt = runner.setup(model, opt)
        backward = runner.backward
    params = list(model.parameters())  # (the norm's list, built once)
    grad_norm = None
    step, epoch = 0, 0
    logged, pending = [], []
    t0 = 0.0
    while step < args.steps:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        loader = DataLoader(data, batch_size=args.batch_size, sampler=order.tolist())
        for batch in loader:
            if device.type != "cpu":  # as the Fitter moves it (an asynchronous copy)
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = loss_of(model(batch), batch)
            backward(loss)
            if norm == "torch":
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            elif norm == "foreach":
                grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == args.warmup:
                _sync(device)
                t0 = time.perf_counter()
                if mark:
                    mark("start")
            if window:
                pending.append(loss.detach())
                if step % 100 == 0:
                    logged.append((torch.stack(pending).mean().item(), grad_norm.item() if grad_norm is not None else None))
                    pending.clear()
            elif step % 50 == 0:  # a fair hand loop also looks at its loss now and then
                logged.append(loss.item() if grad_norm is None else (loss.item(), grad_norm.item()))
            if step == args.steps:
                _sync(device)
                if mark:
                    mark("stop")
                break
        epoch += 1
    return (time.perf_counter() - t0) / (args.steps - args.warmup)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, at the clock's start and stop only (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock(ll.Callback):
    """Times steps warmup+1..steps, the same window as the hand-written loop."""

    def __init__(self, warmup: int, steps: int, mark=None):
        self.warmup, self.steps, self.t0, self.t1, self.mark = warmup, steps, 0.0, 0.0, mark
        self.cpu0 = self.cpu1 = 0.0  # this thread's CPU time (benchmarks/ddp.py reports it too)

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.warmup:
            _sync(fitter.strategy.root_device)
            self.t0, self.cpu0 = time.perf_counter(), time.thread_time()
            if self.mark:
                self.mark("start")
        elif state.global_step == self.steps:
            _sync(fitter.strategy.root_device)
            self.t1, self.cpu1 = time.perf_counter(), time.thread_time()
            if self.mark:
                self.mark("stop")


def with_fitter(data: Data, args: argparse.Namespace, mark=None) -> float:
    torch.manual_seed(0)
    model = MLP(args.features, args.width)
    clock = Clock(args.warmup, args.steps, mark)
    with tempfile.TemporaryDirectory() as out:
        fitter = ll.Fitter(max_steps=args.steps, batch_size=args.batch_size, learning_rate=1e-3,
                           output_dir=out, seed=0, log_level="warning", callbacks=[clock],
                           accelerator=getattr(args, "device", "cpu"))
        fitter.fit(model, data)
    return (clock.t1 - clock.t0) / (args.steps - args.warmup)


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The model and data options (shared with benchmarks/counters.py)."""
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (both loops on it)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=100, help="steps before the clock starts (both loops)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fabric", action="store_true",
                   help="also time the same-work loop through Lightning Fabric (needs lightning installed)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = Data(args.samples, args.features)
    short = argparse.Namespace(**{**vars(args), "steps": 200, "warmup": 100})
    hand_written(data, short)  # warm caches and imports
    if args.fabric:
        hand_written(data, short, norm="foreach", window=True, fabric=True)
    with_fitter(data, short)
    runs: dict[str, list[float]] = {"hand-written, same work": [], "lightlike Fitter": [],
                                    "hand-written, no norm": [], "hand-written, typical": []}
    for _ in range(args.repeats):
        runs["hand-written, same work"].append(hand_written(data, args, norm="foreach", window=True))
        runs["lightlike Fitter"].append(with_fitter(data, args))
        runs["hand-written, no norm"].append(hand_written(data, args))
        runs["hand-written, typical"].append(hand_written(data, args, same_work=False))
        if args.fabric:
            runs.setdefault("Fabric, same work", []).append(hand_written(data, args, norm="foreach", window=True,
                                                                        fabric=True))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{where}, torch {torch.__version__}, threads {args.threads}, width {args.width}, batch {args.batch_size}, "
          f"{args.steps} steps x {args.repeats} repeats")
    for name, times in runs.items():
        print(f"{name:24}: min {min(times) * 1e6:8.1f}  median {statistics.median(times) * 1e6:8.1f} us/step  "
              f"(runs: {', '.join(f'{x * 1e6:.0f}' for x in times)})")
    f = runs["lightlike Fitter"]
    for label, name in (("overhead: fitter / same work", "hand-written, same work"),
                        ("fitter / hand loop, no norm", "hand-written, no norm"),
                        ("defaults: fitter / typical loop", "hand-written, typical"),
                        ("fitter / Fabric, same work", "Fabric, same work")):
        if name not in runs:
            continue
        h = runs[name]
        print(f"{label:32}: {min(f) / min(h):.3f} (min)  {statistics.median(f) / statistics.median(h):.3f} (median)  "
              f"({(min(f) - min(h)) * 1e6:+.1f} us/step)")


if __name__ == "__main__":
    main()

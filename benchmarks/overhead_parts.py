"""Where the Fitter's per-step overhead lives: the same tiny-MLP loop run four ways, alternating.

1. **hand**: a hand-written loop (forward, loss, backward, fused AdamW step, linear schedule,
   ``p.grad = None``), batches from a plain DataLoader.
2. **hand, Fitter's objects**: the same loop, run from ``on_fit_start`` on the module, optimizer,
   scheduler and epoch iterator the Fitter built. Equal to (1): the objects cost nothing.
3. **Fitter's step body**: the same outer loop calling the Fitter's own ``_training_step``
   (batch to device, the step context, item counts, normaliser, contexts, checked module/loss
   calls, strategy backward/step/zero_grad, the scheduler, the pending loss).
4. **Fitter**: ``Fitter.fit`` with its defaults (plus ``save_strategy="no"`` in 2 and 3, whose
   fits end before a step).

Per-step **CPU time of the main thread** (``time.thread_time``) is the figure: it leaves out
the waits the wall clock of a shared machine adds. (3) - (1) is what the step body adds, (4) - (3)
what the outer loop (callbacks, epoch position, log/eval/save checks, log steps) adds. This
script overrides private methods of the Fitter (``_train``, ``_training_step``): it is a
diagnosis of the loop, not an example.

    python benchmarks/overhead_parts.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MLP, Data, model_arguments  # noqa: E402

import lightlike as ll  # noqa: E402


def forever(make_iterator):
    """Batches across epochs: ``make_iterator(epoch)`` for epoch 0, 1, ..."""
    epoch = 0
    while True:
        yield from make_iterator(epoch)
        epoch += 1


def drive(body, batches, scheduler, args) -> tuple[float, float]:
    """Run ``body(batch)`` + ``scheduler.step()`` (unless the body steps it: ``scheduler=None``) for
    ``args.steps`` steps; (CPU, wall) seconds per step after ``args.warmup`` steps."""
    c0 = t0 = 0.0
    for step in range(1, args.steps + 1):
        body(next(batches))
        if scheduler is not None:
            scheduler.step()
        if step == args.warmup:
            c0, t0 = time.thread_time(), time.perf_counter()
    n = args.steps - args.warmup
    return (time.thread_time() - c0) / n, (time.perf_counter() - t0) / n


def hand_body(model, optimizer):
    def body(batch):
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    return body


def hand(data, args):
    torch.manual_seed(0)
    model = MLP(args.features, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / args.steps))

    def epoch(e):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(e))
        return DataLoader(data, batch_size=args.batch_size, sampler=order.tolist())
    return drive(hand_body(model, optimizer), forever(epoch), scheduler, args)


class Inside:
    """Runs a hand loop on the Fitter's objects in place of its training loop (``Fitter._train``)."""

    def __init__(self, args, fitters_body: bool):
        self.args, self.fitters_body, self.result = args, fitters_body, (0.0, 0.0)

    def fitter(self, **kwargs):
        inside = self

        class Probe(ll.Fitter):
            def _train(self, run):
                if inside.fitters_body:
                    def body(batch):
                        self._training_step(run, [batch])  # (steps the scheduler too)
                        run.losses.pending.clear()  # read at log steps in a fit; nobody reads them here
                else:
                    body = hand_body(self.model, self.optimizer)
                batches = forever(run.train_data.epoch_iterator)
                inside.result = drive(body, batches, None if inside.fitters_body else self.scheduler, inside.args)

        return Probe(**kwargs)


def with_fitter(data, args, inside: Inside | None = None):
    torch.manual_seed(0)
    clock = {}

    class Clock(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == args.warmup:
                clock["c0"], clock["t0"] = time.thread_time(), time.perf_counter()
            elif state.global_step == args.steps:
                n = args.steps - args.warmup
                clock["r"] = ((time.thread_time() - clock["c0"]) / n, (time.perf_counter() - clock["t0"]) / n)

    extra = {"save_strategy": "no"} if inside else {}
    with tempfile.TemporaryDirectory() as out:
        kwargs = dict(max_steps=args.steps, batch_size=args.batch_size, learning_rate=1e-3, output_dir=out, seed=0,
                      log_level="warning", **extra)
        fitter = inside.fitter(**kwargs) if inside else ll.Fitter(callbacks=[Clock()], **kwargs)
        fitter.fit(MLP(args.features, args.width), data)
    return inside.result if inside else clock["r"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    data = Data(args.samples, args.features)
    ways = {
        "hand": lambda: hand(data, args),
        "hand, Fitter's objects": lambda: with_fitter(data, args, Inside(args, fitters_body=False)),
        "Fitter's step body": lambda: with_fitter(data, args, Inside(args, fitters_body=True)),
        "Fitter": lambda: with_fitter(data, args),
    }
    short = argparse.Namespace(**{**vars(args), "steps": 200, "warmup": 100})
    hand(data, short)
    with_fitter(data, short)  # imports and first-use costs, outside the clocks
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, run in ways.items():
            runs[name].append(run())
    base = statistics.median(c for c, _ in runs["hand"])
    print(f"torch {torch.__version__}, width {args.width}, batch {args.batch_size}, {args.steps} steps x {args.repeats}")
    for name, r in runs.items():
        cpu, wall = statistics.median(c for c, _ in r), statistics.median(w for _, w in r)
        print(f"{name:24}: CPU {cpu * 1e6:7.1f} us/step ({cpu / base:.3f})  wall {wall * 1e6:7.1f} us/step  "
              f"(CPU runs: {', '.join(f'{c * 1e6:.0f}' for c, _ in r)})")


if __name__ == "__main__":
    main()

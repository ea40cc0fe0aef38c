"""Manual optimization under DDP where the ranks' steps differ: two experts ``a`` and ``b`` in one
Adam optimizer (float64), the batch's loss through the experts a plan says.

    torchrun --nproc_per_node 2 manual_misuse_target.py OUT --plan PLAN [--steps N] [--two] [--then OUT2 ...]

PLAN is ``;``-separated ``step:rank:what`` entries; ``what`` is one of ``a`` / ``b`` (that rank
backpropagates through that expert alone at that step), ``none`` (no ``ctx.backward``; ``ctx.step``
still called), ``nostep`` (``ctx.backward`` but no ``ctx.step``), ``twice`` (two updates, one per half
batch) or ``direct`` (``opt.step()`` on the raw
optimizer instead of ``ctx.step``). Other steps use both experts.

Writes ``final-rank<r>.pt``: the weights, the optimizer's state and the batches this rank saw.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

import lightlike as ll


class Experts(ll.TaskModule):
    def __init__(self, plan: dict[tuple[int, int], str]):
        super().__init__()
        self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)
        self.plan, self.rank, self.seen = plan, int(os.environ.get("RANK", "0")), []

    def forward(self, batch):
        return self.a(batch["x"]) + self.b(batch["x"])

    def configure_optimizers(self, config):
        return torch.optim.Adam(self.parameters(), 0.1)

    def training_step(self, batch, ctx):
        (opt,) = ctx.optimizers
        what = self.plan.get((ctx.global_step, self.rank), "ab")
        experts = what if what in ("a", "b") else "ab"
        self.seen.append({k: v.clone() for k, v in batch.items()})
        x, y = batch["x"], batch["y"]
        if what == "twice":  # two updates in one training_step: each half of the batch
            for half in (slice(0, 2), slice(2, 4)):
                ctx.backward(((self.a(x[half]) + self.b(x[half]) - y[half]) ** 2).mean())
                ctx.step(opt)
            return ((self(batch) - y) ** 2).mean().detach()
        out = sum((getattr(self, e)(x) for e in experts), torch.zeros_like(y))
        loss = ((out - y) ** 2).mean()
        if what != "none":
            ctx.backward(loss)
        if what == "direct":
            opt.step()
        elif what != "nostep":
            ctx.step(opt)
        return loss.detach()


class TwoOptimizers(Experts):
    """One optimizer per expert, both stepped each step; ``skip0`` in the plan: that rank skips
    the first one's ctx.step."""

    def configure_optimizers(self, config):
        return [torch.optim.Adam(self.a.parameters(), 0.1), torch.optim.Adam(self.b.parameters(), 0.1)]

    def training_step(self, batch, ctx):
        ctx.backward(((self(batch) - batch["y"]) ** 2).mean())
        for i, opt in enumerate(ctx.optimizers):
            if not (i == 0 and self.plan.get((ctx.global_step, self.rank)) == "skip0"):
                ctx.step(opt)
        return torch.zeros(())


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def parse_plan(text: str) -> dict[tuple[int, int], str]:
    plan = {}
    for entry in filter(None, text.split(";")):
        step, rank, what = entry.split(":")
        plan[int(step), int(rank)] = what
    return plan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plan", default="")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--two", action="store_true", help="TwoOptimizers")
    args = p.parse_args(argv)
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    module = (TwoOptimizers if args.two else Experts)(parse_plan(args.plan)).double()
    fitter = ll.Fitter(max_steps=args.steps, batch_size=4, output_dir=str(out / "run"), loggers=[], shuffle=False,
                       log_level="warning", strategy="ddp", model_summary=False, progress_bar=False, save_every=None)
    fitter.fit(module, Rows())
    torch.save({"weights": module.state_dict(), "optimizer": fitter.optimizer.optimizers[0].state_dict(),
                "seen": module.seen}, out / f"final-rank{rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ddp_target import each  # noqa: E402

    each(sys.argv[1:], run=main)

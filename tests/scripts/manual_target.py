"""Manual optimization on several processes: the GAN of tests/helpers.py in float64.

    torchrun --nproc_per_node 2 manual_target.py OUT --batch 4 [--steps N] [--strategy S] [--stop K] [--resume]
        [--then OUT2 ...]

``--then`` starts another run in the same launch (processes, process group), into its own OUT,
as ddp_target.py's does.

Writes ``final-rank<r>.pt``: the weights and both optimizers' states.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import GAN, MixtureDataset, gan_losses  # noqa: E402

import lightlike as ll  # noqa: E402


class ShardedGAN(GAN):
    """G and D are FSDP shard units: training_step calls D on its own."""

    def fsdp_units(self):
        return [self.G, self.D]


class AccumulatingGAN(ShardedGAN):
    """D's loss over the batch's two halves: the first half's backward under ctx.no_sync(), each
    half's loss weighted 1/2 (the halves are equal): the same gradient as the whole batch's."""

    def training_step(self, batch, ctx):
        opt_g, opt_d = ctx.optimizers
        fake = self(batch)
        half = len(fake) // 2
        with ctx.no_sync():
            ctx.backward(0.5 * gan_losses(self.D, fake[:half], batch["x"][:half])[0])
        loss_d, generator_loss = gan_losses(self.D, fake[half:], batch["x"][half:])
        ctx.backward(0.5 * loss_d)
        ctx.step(opt_d)
        self.D.requires_grad_(False)
        loss_g = gan_losses(self.D, fake, batch["x"])[1]()
        ctx.backward(loss_g)
        ctx.step(opt_g)
        self.D.requires_grad_(True)
        return loss_g.detach()


class StopAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--stop", type=int, default=0, help="stop after this step (its checkpoint is saved)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--accumulate", action="store_true", help="AccumulatingGAN: ctx.no_sync() over half batches")
    args = p.parse_args(argv)
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    module = (AccumulatingGAN if args.accumulate else ShardedGAN if args.strategy == "fsdp" else GAN)().double()
    fitter = ll.Fitter(max_steps=args.steps, batch_size=args.batch, output_dir=str(out / "run"), loggers=["jsonl"], log_every=1,
                       log_level="warning", strategy=args.strategy, max_grad_norm=0.5, model_summary=False,
                       progress_bar=False, save_every=2, callbacks=[StopAt(args.stop)] if args.stop else [])
    fitter.fit(module, MixtureDataset(n=44, dtype=torch.float64), resume=args.resume or None)
    weights = fitter.strategy.checkpoint_layout.module_state_dict(fitter.model)  # full weights (gathered under FSDP)
    optimizers = [] if args.strategy == "fsdp" else [o.state_dict() for o in fitter.optimizer.optimizers]
    torch.save({"weights": weights, "optimizers": optimizers}, out / f"final-rank{rank}.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ddp_target import each  # noqa: E402  (its split of OUT ARGS --then OUT ARGS ...)

    each(sys.argv[1:], run=main)

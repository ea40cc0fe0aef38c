"""Things the other DDP targets cannot show, because their ranks draw the same random numbers
and never see a non-finite loss or gradient; used by tests/strategies/test_ddp.py (and the
non-finite gradient tests of test_fsdp.py and test_deepspeed.py).

    rank_streams_target.py OUT rng [--stop N]   ranks draw different amounts from torch, numpy and
                                                 Python's generators; --stop N: killed after step N
    rank_streams_target.py OUT nan POLICY       a NaN loss on rank 1 only, in its 3rd micro-batch
    rank_streams_target.py OUT nangrad POLICY STRATEGY
                                                 a finite loss with a NaN gradient on rank 1 only,
                                                 at step 3 of 4 (checkpoint at every step); a rank
                                                 that raises writes OUT/error-rank{R}.txt

Each rank writes OUT/final-rank{R}.pt (weights) and OUT/result-rank{R}.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


class RankStreams(Classifier):
    """Rank r draws (r + 1) times as many numbers from each generator (as ranks whose sequences
    have other lengths do): restoring rank 0's states on every rank would change rank 1's run."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, batch):
        x = batch["x"]
        if self.training:
            wide = x.repeat(1, RANK + 1)
            noise = np.random.normal(size=tuple(wide.shape))[:, : x.shape[1]] + random.random() * (RANK + 1)
            x = self.drop(wide)[:, : x.shape[1]] + 0.01 * torch.as_tensor(noise, dtype=x.dtype)
        return self.net(x)


class NaNOnRank1(Classifier):
    calls = 0

    def loss(self, outputs, batch):
        loss = super().loss(outputs, batch)
        if self.training:
            type(self).calls += 1
            if RANK == 1 and type(self).calls == 3:
                return loss * float("nan")
        return loss


class NaNGradientOnRank1(Classifier):
    """Rank 1's 3rd training loss is finite with a NaN gradient (0 * sqrt'(0)): every rank's
    reduced gradient is NaN."""

    calls = 0

    def loss(self, outputs, batch):
        loss = super().loss(outputs, batch)
        if self.training:
            type(self).calls += 1
            if RANK == 1 and type(self).calls == 3:
                return loss + 0.0 * (outputs - outputs.detach()).abs().sqrt().sum()
        return loss


class KilledAfter(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            os._exit(9)  # a rank dying right after the step whose checkpoint was just written


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    if mode == "rng":
        stop = int(sys.argv[sys.argv.index("--stop") + 1]) if "--stop" in sys.argv else None
        module = RankStreams().double()
        resume = (out / "checkpoint-4").is_dir()
        fitter = ll.Fitter(max_steps=8, batch_size=4, save_every=2, learning_rate=1e-2, output_dir=str(out),
                           loggers=[], log_level="warning", seed=0, model_summary=False,
                           callbacks=[KilledAfter(stop)] if stop else [], overwrite_output_dir=not resume)
        result = fitter.fit(module, DictDataset(n=40, dtype=torch.float64), resume=True if resume else None)
    elif mode == "nan":
        module = NaNOnRank1().double()
        fitter = ll.Fitter(max_steps=6, batch_size=4, output_dir=str(out), loggers=[], log_level="warning",
                           nonfinite_loss=sys.argv[3], log_every=1, model_summary=False)
        result = fitter.fit(module, DictDataset(n=48, dtype=torch.float64))
    else:  # nangrad: float32 (DeepSpeed refuses float64); read at saves only (log_every > max_steps)
        module = NaNGradientOnRank1()
        fitter = ll.Fitter(max_steps=4, batch_size=4, save_every=1, output_dir=str(out), loggers=[],
                           log_level="warning", nonfinite_loss=sys.argv[3], strategy=sys.argv[4],
                           log_every=100, model_summary=False)
        try:
            result = fitter.fit(module, DictDataset(n=32))
        except ll.NonFiniteLossError as error:  # each rank says what it raised; then all stop together
            (out / f"error-rank{RANK}.txt").write_text(f"{type(error).__name__}: {error}")
            torch.distributed.barrier()
            sys.exit(3)
    rank = fitter.strategy.global_rank
    weights = fitter.strategy.checkpoint_layout.module_state_dict(fitter.model)  # full weights (collective under FSDP/ZeRO)
    torch.save({k: v.detach().clone().cpu() for k, v in weights.items()}, out / f"final-rank{rank}.pt")
    (out / f"result-rank{rank}.json").write_text(json.dumps({"skipped": result.skipped_steps,
                                                             "loss": result.training_loss}))


if __name__ == "__main__":
    main()

"""A fit on a DataLoader of the user's that SIGKILLs itself after a chosen step; used by
tests/data/test_user_loader_resume.py.

    python user_loader_target.py OUT_DIR --loader shuffle|sequential|distributed|weighted|own_generator
        [--workers N] [--kill-after STEP]

26 items in batches of 4 (7 batches an epoch, the last short), 2 epochs, a checkpoint every 2
steps: a kill after step 5 leaves checkpoint-4, in the middle of epoch 0. Without a kill it runs
(or resumes) to the end and writes OUT_DIR/final.safetensors.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import DictDataset, Dropout  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.checkpoint import find_latest_valid  # noqa: E402


class KillAfter(ll.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            print(f"kill fired after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def loader(kind: str, workers: int) -> DataLoader:
    data = DictDataset(n=26)
    common = dict(batch_size=4, num_workers=workers)
    if kind == "shuffle":
        return DataLoader(data, shuffle=True, **common)
    if kind == "sequential":
        return DataLoader(data, shuffle=False, **common)
    if kind == "distributed":
        return DataLoader(data, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=11), **common)
    weights = torch.linspace(1.0, 3.0, 26)
    if kind == "weighted":
        return DataLoader(data, sampler=WeightedRandomSampler(weights, 26), **common)
    own = torch.Generator().manual_seed(5)
    return DataLoader(data, sampler=WeightedRandomSampler(weights, 26, generator=own), **common)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--loader", required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--kill-after", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = Dropout()
    resume = find_latest_valid(args.out) is not None
    fitter = ll.Fitter(max_epochs=2, learning_rate=1e-2, save_every=2, log_every=1, loggers=["jsonl"],
                       output_dir=args.out, seed=3, overwrite_output_dir=not resume, model_summary=False,
                       log_level="info", callbacks=[KillAfter(args.kill_after)] if args.kill_after else [])
    fitter.fit(model, loader(args.loader, args.workers), resume=resume)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.safetensors"))


if __name__ == "__main__":
    main()

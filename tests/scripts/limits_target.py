"""A script tests/loop/test_batch_limits.py launches with torchrun: limit_train_batches and
limit_val_batches on several processes. Each rank writes ``OUT/rank<r>.json``.

    torchrun --nproc_per_node 2 limits_target.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402


class Indexed(DictDataset):
    def __getitem__(self, i):
        return {**super().__getitem__(i), "i": torch.tensor(i)}


class IndexMean(Classifier):
    """val/index: the mean index of the items evaluated."""

    def metrics(self, outputs, batch):
        return {"index": batch["i"].double().mean()}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    steps = []

    class Steps(ll.Callback):
        def on_step_end(self, fitter, state, control):
            steps.append((state.global_step, state.epoch_index, state.batches_in_epoch))

    f = ll.Fitter(max_epochs=2, limit_train_batches=2, limit_val_batches=2, batch_size=3, eval_on_epoch_end=True,
                  output_dir=str(out / "run"), loggers=[], model_summary=False, accelerator="cpu",
                  callbacks=[Steps()])
    result = f.fit(IndexMean(), Indexed(n=40), Indexed(n=30, seed=1))
    validated = ll.Fitter(limit_val_batches=0.5, batch_size=3, output_dir=str(out / "v"), loggers=[],
                          accelerator="cpu").validate(IndexMean(), Indexed(n=30, seed=1))
    (out / f"rank{rank}.json").write_text(json.dumps({
        "steps": steps, "global_step": result.global_step, "fit_index": result.metrics["val/index"],
        "validate_index": validated["val/index"]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""A script tests/checkpoint/test_resume_changes.py launches under torchrun: resume OUT's newest checkpoint
(26 indexed items, batch 3, max_epochs 2) and write OUT/served-rank<r>.json, the (epoch, item
indices) of every training micro-batch this rank took.

    torchrun --nproc_per_node 2 resume_world_size_target.py OUT
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
    """DictDataset whose items also carry their index ``i``."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "i": torch.tensor(i)}


class Recording(Classifier):
    """Records the indices of each training batch, with the epoch it belongs to."""

    def __init__(self):
        super().__init__()
        self.served: list[tuple[int, list[int]]] = []
        self.epoch_now = 0

    def forward(self, batch):
        if self.training:
            self.served.append((self.epoch_now, batch["i"].tolist()))
        return super().forward(batch)


class Epoch(ll.Callback):
    def on_step_start(self, fitter, state, control):
        fitter.module.epoch_now = state.epoch_index


def main(out: str) -> None:
    module = Recording()
    ll.Fitter(output_dir=out, loggers=[], log_level="warning", log_level_other_ranks="warning", save_every=100,
              max_epochs=2, batch_size=3, callbacks=[Epoch()]).fit(module, Indexed(n=26), resume=True)
    rank = int(os.environ.get("RANK", 0))
    Path(out, f"served-rank{rank}.json").write_text(json.dumps(module.served))


if __name__ == "__main__":
    main(sys.argv[1])

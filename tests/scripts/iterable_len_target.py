"""A script tests/evaluation/test_evaluation_on_ranks.py launches with torchrun: IterableDatasets whose ``__len__``
is wrong, trained by epochs with accumulation on several ranks. Each rank writes
``OUT/rank<r>.json``: per case, the steps taken, the items each rank trained on, and the
warnings it logged; last, the error of a fit in which one rank's first epoch is empty.

    torchrun --nproc_per_node 2 iterable_len_target.py OUT
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import IterableDataset

import lightlike as ll


class Stream(IterableDataset):
    """``items`` items, of which ``__len__`` claims ``claims``."""

    def __init__(self, items: int, claims: int):
        self.items, self.claims = items, claims

    def __len__(self):
        return self.claims

    def __iter__(self):
        for i in range(self.items):
            yield {"x": torch.full((4,), float(i)), "y": torch.tensor(i % 3), "i": torch.tensor(i)}


class EmptyOnRank1First(IterableDataset):
    """Shards itself: rank 1 yields nothing in its first epoch, rank 0 two items."""

    shards_itself = True

    def __iter__(self):
        if int(os.environ["RANK"]) == 1:
            return
        for i in range(2):
            yield {"x": torch.full((4,), float(i)), "y": torch.tensor(i % 3), "i": torch.tensor(i)}


class Module(ll.TaskModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.seen: list[int] = []

    def forward(self, batch):
        self.seen.extend(batch["i"].tolist())
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    res = {}
    for name, items, claims in (("claims_more", 7, 8), ("claims_fewer", 13, 9)):
        warnings = Warnings()
        logging.getLogger("lightlike").addHandler(warnings)
        module = Module()
        result = ll.Fitter(max_epochs=2, batch_size=1, grad_accum_steps=2, output_dir=str(out / name), loggers=[],
                           log_level="warning").fit(module, Stream(items, claims))
        logging.getLogger("lightlike").removeHandler(warnings)
        res[name] = {"steps": result.global_step, "seen": module.seen, "warnings": warnings.lines}
    try:  # last: one rank's share of the first epoch is empty, so no rank may take a step
        ll.Fitter(max_steps=4, batch_size=1, output_dir=str(out / "empty_first"), loggers=[],
                  log_level="error").fit(Module(), EmptyOnRank1First())
        res["empty_first"] = "trained"
    except ll.errors.DataError as e:
        res["empty_first"] = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()

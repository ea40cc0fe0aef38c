"""A script tests/data/test_data_counts_and_eval_samplers.py launches under torchrun (or as one process).

    torchrun --nproc_per_node 2 data_counts_target.py OUT

Writes OUT/rank<r>.json: per training case, the (step, samples_seen, samples_in_epoch, epoch) each
rank's FitState holds at every on_step_end and the items the ranks trained on; per evaluation
case, the items predict() returned, in order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Sampler,
    SubsetRandomSampler,
)

import lightlike as ll


class Items(torch.utils.data.Dataset):
    """Item i: x = i / 10, y = i % 3, i; ``ds[list]`` is the batch of those items (a batched read)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, list):
            return torch.utils.data.default_collate([self[j] for j in i])
        return {"x": torch.full((4,), float(i) / 10), "y": torch.tensor(i % 3), "i": torch.tensor(i)}


class Stream(IterableDataset):
    """``n`` items; a ``__len__`` of ``claims`` (None: no length, a stream)."""

    def __init__(self, n, claims=None):
        self.n, self.claims = n, claims

    def __len__(self):
        if self.claims is None:
            raise TypeError("a stream has no length")
        return self.claims

    def __iter__(self):
        return (Items(self.n)[i] for i in range(self.n))


class Lists(Sampler):
    """Index lists of varying length, not a BatchSampler: ready-made batches with batch_size=None."""

    def __iter__(self):
        yield from ([0, 1, 2], [3, 4], [5, 6, 7, 8], [9])

    def __len__(self):
        return 4


class Buckets:
    """A batch_sampler of the user's: batches of varying length over items 10..19."""

    batch_size = 4

    def __iter__(self):
        return iter([[19, 18, 17, 16], [15, 14], [13, 12, 11], [10]])

    def __len__(self):
        return 4


class Model(ll.TaskModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 3)
        self.items = 0

    def forward(self, batch):
        if self.training:
            self.items += len(batch["y"])
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])

    def predictions(self, outputs, batch):  # which items were evaluated, in the order returned
        return batch["i"]


class Record(ll.Callback):
    def __init__(self):
        self.rows = []

    def on_step_end(self, fitter, state, control):
        self.rows.append([state.global_step, state.samples_seen, state.samples_in_epoch, round(state.epoch, 4)])


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    result: dict = {}
    train_cases = {
        # (data, batch_size, accumulation, max_steps or None for one epoch)
        "stream-no-length": (Stream(13), 2, 2, 2),
        "stream-over-claiming": (Stream(13, claims=21), 2, 2, None),
        "stream-with-length": (Stream(10, claims=10), 4, 1, None),
        "distributed-sampler-9": (None, 4, 1, None),
    }
    for case, (data, batch, accum, steps) in train_cases.items():
        if data is None:  # a DistributedSampler over 9 items pads to 10
            ds = Items(9)
            data = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=world, rank=rank,
                                                                           shuffle=False))
        model, record = Model(), Record()
        ll.Fitter(batch_size=batch, grad_accum_steps=accum, max_steps=steps, max_epochs=None if steps else 1,
                  output_dir=str(out / case), loggers=[], log_level="error", save_strategy="no",
                  callbacks=[record]).fit(model, data)
        items = torch.tensor(model.items)
        if world > 1:
            torch.distributed.all_reduce(items)
        result[case] = {"rows": record.rows, "items_trained": int(items)}
    fitter = ll.Fitter(output_dir=str(out / "eval"), loggers=[], log_level="error", eval_batch_size=4)
    ds, val = Items(20), [15, 16, 17, 18, 19]
    eval_cases = {
        "subset-random-sampler": DataLoader(ds, batch_size=4, sampler=SubsetRandomSampler(val)),
        "batch-sampler-over-a-subset": DataLoader(ds, batch_sampler=BatchSampler(SubsetRandomSampler(val), 4, False)),
        "sampler-of-index-lists": DataLoader(ds, batch_size=None, sampler=Lists()),
        "batch-sampler-of-the-users": DataLoader(ds, batch_sampler=Buckets()),
    }
    for case, loader in eval_cases.items():
        result[case] = fitter.predict(Model(), loader).predictions.tolist()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

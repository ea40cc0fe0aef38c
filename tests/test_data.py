"""Data utilities: the resumable sampler and IterableDataset sharding."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

import lightlike as ll
from lightlike.data.iterable import ShardedIterable
from lightlike.data.sampler import ResumableSampler


class Count(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.full((8,), float(i)), "y": torch.tensor(i % 3), "i": torch.tensor(i)}


def test_sampler_seek_and_ranks():
    full = list(ResumableSampler(23, seed=4))
    s = ResumableSampler(23, seed=4)
    s.set_epoch(0, start=10)
    assert list(s) == full[10:]
    shares = []
    for r in range(3):
        s = ResumableSampler(23, seed=4, rank=r, world_size=3)
        shares.append(list(s))
    assert sorted(sum(shares, [])) == list(range(23))  # evaluation: every item once, no padding
    even = [list(ResumableSampler(23, seed=4, rank=r, world_size=3, even=True)) for r in range(3)]
    assert [len(x) for x in even] == [7, 7, 7] and len(set(sum(even, []))) == 21


def test_iterable_sharded_over_ranks_and_workers():
    seen = []
    for rank in range(2):
        loader = DataLoader(ShardedIterable(Count(20), rank, 2), batch_size=None, num_workers=2)
        seen += [int(item["i"]) for item in loader]
    assert sorted(seen) == list(range(20))


def test_fit_on_iterable_with_workers(tmp_path):
    ids = []

    class Record(ll.TaskModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 3)

        def forward(self, batch):
            ids.extend(batch["i"].tolist())
            return self.lin(batch["x"])

        def loss(self, outputs, batch):
            return torch.nn.functional.cross_entropy(outputs, batch["y"])

    # each worker holds 10 items: batches of 4, 4, 2 -> 6 batches in one pass
    ll.Fitter(max_steps=6, batch_size=4, num_workers=2, output_dir=str(tmp_path), loggers=[]).fit(Record(), Count(20))
    assert sorted(ids) == list(range(20))  # 2 workers, no item twice

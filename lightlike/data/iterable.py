"""Sharding an ``IterableDataset`` over ranks and DataLoader workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


class ShardedIterable(IterableDataset):
    """Yields the items of ``dataset`` whose position ``i`` satisfies
    ``i % (world_size * workers) == rank * workers + worker_id``: every item once, across all
    ranks and workers, in the dataset's own order within each shard.

    A dataset that shards itself (it reads ``get_worker_info()`` or takes rank arguments) should
    be passed as it is: set ``shards_itself = True`` on it and lightlike leaves it alone."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int):
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        shards = self.world_size * workers
        mine = self.rank * workers + worker
        for i, item in enumerate(self.dataset):
            if i % shards == mine:
                yield item

"""Sharding an ``IterableDataset`` over ranks and DataLoader workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


class ShardedIterable(IterableDataset):
    """Yields the items of ``dataset`` whose position ``i`` satisfies
    ``i % (world_size * workers) == rank * workers + worker_id``: every item once, across all
    ranks and workers, in the dataset's own order within each shard.

    ``block=B`` (evaluation, with a DataLoader of batch size B) shards so that order survives:
    rank r takes the items with ``i % world_size == r`` (round-robin, as the evaluation sampler
    deals a map-style set, so gathered predictions interleave back into dataset order), and its
    workers take turns over runs of B of them, so the DataLoader, which takes one batch from
    each worker in turn, yields the rank's items in order.

    A dataset that shards itself (it reads ``get_worker_info()`` or takes rank arguments) should
    be passed as it is: set ``shards_itself = True`` on it and lightlike leaves it alone."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, block: int | None = None):
        if block is not None and block < 1:
            raise ValueError(f"block must be a positive int or None, got {block!r}")
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.block = block

    def batches(self, batch_size: int, drop_last: bool, workers: int) -> int:
        """This rank's batches of a training epoch (no ``block``) when the dataset has a length
        (``TypeError`` when it has none): each DataLoader worker batches its own shard, so every
        worker's last batch may be short (``len()`` of the DataLoader assumes one stream and
        counts too few)."""
        if self.block is not None:
            raise TypeError("an evaluation shard's batches are not counted ahead")
        n, workers = len(self.dataset), max(1, workers)  # type: ignore[arg-type]
        shards = self.world_size * workers
        total = 0
        for k in range(workers):
            first = self.rank * workers + k  # this shard's first position
            items = -(-(n - first) // shards) if n > first else 0
            total += items // batch_size if drop_last else -(-items // batch_size)
        return total

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if self.block is not None:
            mine_seen = 0  # this rank's items so far
            for i, item in enumerate(self.dataset):
                if i % self.world_size == self.rank:
                    if (mine_seen // self.block) % workers == worker:
                        yield item
                    mine_seen += 1
            return
        shards = self.world_size * workers
        mine = self.rank * workers + worker
        for i, item in enumerate(self.dataset):
            if i % shards == mine:
                yield item

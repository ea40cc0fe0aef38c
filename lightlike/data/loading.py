"""Turning what the user passes (Datasets or DataLoaders) into the loaders the loop reads."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightlike.data.iterable import ShardedIterable
from lightlike.data.sampler import ResumableSampler
from lightlike.errors import DataError

log = logging.getLogger("lightlike")


@dataclass
class TrainData:
    """The training loader plus what the loop needs to know about it."""

    loader: DataLoader
    sampler: ResumableSampler | None  # None: the user's own DataLoader or an IterableDataset
    num_samples: int | None  # samples per epoch (global), when known
    seed: int
    generator: torch.Generator | None

    def batches_per_epoch(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None

    def samples_after(self, batches: int, world_size: int) -> int:
        """Global samples consumed after ``batches`` batches on each rank: batches are dealt
        round-robin from the global order, so this is ``batches * batch_size * world_size``,
        capped at the epoch's length (the last batch may be short)."""
        consumed = batches * (self.loader.batch_size or 1) * world_size
        end = self.sampler.global_end() if self.sampler is not None else self.num_samples
        return min(consumed, end) if end is not None else consumed

    def epoch_iterator(self, epoch: int, start_sample: int = 0) -> Any:
        """An iterator over the batches of ``epoch`` beginning ``start_sample`` samples in."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start_sample)
        elif start_sample:
            raise DataError(
                "cannot resume mid-epoch: the training data is a DataLoader without lightlike's "
                "ResumableSampler or an IterableDataset; pass a map-style Dataset instead"
            )
        elif hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            self.loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]  # e.g. a DistributedSampler
        if self.generator is not None:
            self.generator.manual_seed(self.seed + epoch)  # DataLoader worker seeds
        return iter(self.loader)


def _check_nonempty(data: Any, what: str) -> int | None:
    try:
        n = len(data)
    except TypeError:
        return None
    if n == 0:
        raise DataError(f"the {what} data is empty: pass a dataset with at least one item")
    return n


def build_train_data(
    data: Any,
    *,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    num_workers: int,
    pin_memory: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    collate_fn: Callable | None = None,
) -> TrainData:
    if data is None:
        raise DataError("fit() needs training data: fit(module, train_dataset, val_dataset)")
    if isinstance(data, DataLoader):
        if not isinstance(data.dataset, IterableDataset):
            _check_nonempty(data.dataset, "training")
        sampler = data.sampler if isinstance(data.sampler, ResumableSampler) else None
        n = sampler.n if sampler is not None else None
        return TrainData(data, sampler, n, seed, data.generator)
    if not isinstance(data, Dataset) and not hasattr(data, "__getitem__"):
        raise DataError(
            f"training data of type {type(data).__name__} is neither a torch Dataset nor a DataLoader"
        )
    generator = torch.Generator()
    generator.manual_seed(seed)
    if isinstance(data, IterableDataset):
        if (world_size > 1 or num_workers > 1) and not getattr(data, "shards_itself", False):
            data = ShardedIterable(data, rank, world_size)  # each item once over ranks and workers
        loader = DataLoader(data, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last,
                            pin_memory=pin_memory, collate_fn=collate_fn, generator=generator)
        return TrainData(loader, None, None, seed, generator)
    n = _check_nonempty(data, "training")
    assert n is not None
    if drop_last and n // world_size < batch_size:
        raise DataError(
            f"drop_last=True with batch_size={batch_size} leaves no batch of the {n} training items; "
            "lower batch_size or set drop_last=False"
        )
    sampler = ResumableSampler(n, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, even=True)
    if world_size > 1 and n % world_size:
        log.warning("%d training items do not split evenly over %d processes: %d item(s) of each epoch's "
                    "shuffled order are left out so every process takes the same number of steps",
                    n, world_size, n % world_size)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        drop_last=drop_last, pin_memory=pin_memory, collate_fn=collate_fn,
                        generator=generator)
    return TrainData(loader, sampler, n, seed, generator)


def build_eval_loader(
    data: Any,
    *,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    rank: int = 0,
    world_size: int = 1,
    collate_fn: Callable | None = None,
    name: str = "eval",
) -> DataLoader:
    """In-order loader; on several ranks each takes a disjoint, unpadded share. It has its own
    generator: starting an iterator must not draw from the global RNG (that would perturb the
    training run's dropout stream every time it evaluates)."""
    if isinstance(data, DataLoader):
        return data
    if not isinstance(data, Dataset) and not hasattr(data, "__getitem__"):
        raise DataError(f"{name} data of type {type(data).__name__} is neither a Dataset nor a DataLoader")
    if isinstance(data, IterableDataset):
        return DataLoader(data, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                          generator=torch.Generator())
    n = _check_nonempty(data, name)
    assert n is not None
    sampler = ResumableSampler(n, shuffle=False, rank=rank, world_size=world_size)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, collate_fn=collate_fn, generator=torch.Generator())


def normalise_eval_sets(data: Any, default_name: str = "val") -> dict[str, Any]:
    """``None`` → {}, a mapping → itself, anything else → ``{default_name: data}``."""
    if data is None:
        return {}
    if isinstance(data, Mapping):
        for k in data:
            if not isinstance(k, str) or not k or "/" in k:
                raise DataError(f"evaluation set names must be non-empty strings without '/', got {k!r}")
        return dict(data)
    return {default_name: data}

"""What lightlike reads off a DataLoader (its batching, its samplers, the items of an epoch) and
how it rebuilds one like it: shared by the training data (``loading``), its position in an
epoch (``position``) and the evaluation loaders (``eval_loading``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightlike.data.iterable import ShardedIterable
from lightlike.data.sampler import ResumableSampler
from lightlike.data.workers import end_with_parent
from lightlike.errors import DataError


def check_nonempty(data: Any, what: str) -> int | None:
    try:
        n = len(data)
    except TypeError:
        return None
    if n == 0:
        raise DataError(f"the {what} data is empty: pass a dataset with at least one item")
    return n


def batching(loader: DataLoader) -> tuple[int | None, bool, bool]:
    """``(batch_size, drop_last, custom)``: ``custom`` when the loader has a batch_sampler of the
    user's, whose own ``batch_size``/``drop_last`` are read when it has them."""
    bs = loader.batch_sampler
    if bs is None or (type(bs) is BatchSampler and loader.batch_size is not None):  # torch's own batching
        return loader.batch_size, bool(loader.drop_last), False
    if type(bs) is BatchSampler:  # a plain BatchSampler passed as batch_sampler=: its settings are kept
        return bs.batch_size, bool(bs.drop_last), False
    size = getattr(bs, "batch_size", None)
    return (size if isinstance(size, int) else None), bool(getattr(bs, "drop_last", False)), True


def batch_items(loader: DataLoader) -> int:
    """Items in a full batch of ``loader`` (a batch sampler's own ``batch_size``); 1 where each
    element is a ready-made batch (``batch_size=None``), or the batch sampler tells no size."""
    if loader.batch_size is not None:
        return loader.batch_size
    bs: Any = loader.batch_sampler
    if bs is None and isinstance(loader.sampler, BatchSampler):  # index lists, each read at once
        bs = loader.sampler
    size = getattr(bs, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else 1


def epoch_items(loader: DataLoader, world_size: int) -> int | None:
    """The items (global) the sampler of a DataLoader of the user's gives in an epoch, where it
    tells: its length on one process; a ``DistributedSampler``'s items without its padding, a
    ``ResumableSampler``'s dealt samples. None where unknown (an IterableDataset's items are
    counted batch by batch instead)."""
    if isinstance(loader.dataset, IterableDataset):
        return None
    bs = loader.batch_sampler
    sampler: Any = None
    if bs is None:  # ready-made batches: a BatchSampler's items, else the sampler's elements
        sampler = loader.sampler.sampler if isinstance(loader.sampler, BatchSampler) else loader.sampler
    else:  # torch's BatchSampler holds the loader's sampler; the user's may hold one
        sampler = getattr(bs, "sampler", None)
    try:
        if sampler is None:
            return None
        if isinstance(sampler, DistributedSampler):  # its padding repeats items: left out
            return min(len(sampler.dataset), sampler.total_size)  # type: ignore[arg-type]
        if isinstance(sampler, ResumableSampler):
            return sampler.global_end()
        return len(sampler) if world_size == 1 else None
    except TypeError:
        return None


def already_split(loader: DataLoader, *, for_eval: bool = False, rank: int = 0, world_size: int = 1) -> bool:
    """Whether the user's loader already gives this rank its own share."""
    if isinstance(loader.dataset, IterableDataset):
        return bool(getattr(loader.dataset, "shards_itself", False)) or isinstance(loader.dataset, ShardedIterable)
    sampler = loader.sampler
    if for_eval:  # only what lightlike would build itself: in order, unpadded, this rank's
        return (type(sampler) is ResumableSampler and not sampler.shuffle and not sampler.drop_last
                and sampler.start == 0 and (sampler.rank, sampler.world_size) == (rank, world_size)
                and batching(loader)[1:] == (False, False))
    # also a sampler inside a BatchSampler (batch_sampler=, or sampler= for ready-made batches)
    for s in samplers_of(loader):
        if isinstance(s, ResumableSampler) and s.world_size != world_size:
            raise DataError(f"the training DataLoader's {type(s).__name__} has world_size={s.world_size} but the "
                            f"job runs {world_size} processes: build it with rank=..., world_size=... of this job "
                            "(or pass the Dataset and let the Fitter split it)")
        if isinstance(s, (ResumableSampler, DistributedSampler)):
            return True
    return False


def loader_like(loader: DataLoader, dataset: Any, sampler: Any, batch_size: int | None, drop_last: bool,
                 generator: torch.Generator, in_order: bool | None = None) -> DataLoader:
    """A DataLoader over ``dataset`` with ``loader``'s workers, collate_fn and memory settings."""
    kwargs: dict[str, Any] = dict(
        batch_size=batch_size, sampler=sampler, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, drop_last=drop_last, timeout=loader.timeout,
        worker_init_fn=end_with_parent(loader.worker_init_fn, loader.num_workers, loader.multiprocessing_context),
        multiprocessing_context=loader.multiprocessing_context,
        generator=generator, persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device, in_order=loader.in_order if in_order is None else in_order)
    if loader.num_workers:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(dataset, **kwargs)


def known_order(sampler: Any) -> range | list[int] | None:
    """The elements evaluation takes from one of torch's samplers or lightlike's, each once and in
    order (a shuffling one's items in their order, a ``DistributedSampler`` without its padding,
    a ``SubsetRandomSampler``'s indices in the order given); None for any other sampler."""
    kind = type(sampler)
    if kind is SequentialSampler:
        return range(len(sampler))
    if kind is RandomSampler:
        return range(len(sampler.data_source))  # type: ignore[arg-type]
    if kind is WeightedRandomSampler:
        return range(len(sampler.weights))
    if kind is SubsetRandomSampler:
        return [int(i) for i in sampler.indices]
    if kind is DistributedSampler:
        return range(len(sampler.dataset))  # type: ignore[arg-type]
    if isinstance(sampler, ResumableSampler):
        return range(sampler.n)
    return None


def yields_lists(sampler: Any) -> bool:
    """Whether ``sampler`` gives index lists (ready-made batches): a BatchSampler, or a sampler of
    the user's whose first element is a list (told by reading it)."""
    if isinstance(sampler, BatchSampler):
        return True
    if known_order(sampler) is not None:
        return False
    try:
        with torch.random.fork_rng(devices=[]):
            first = next(iter(sampler), None)
    except Exception:  # noqa: BLE001 (it is read again where it is used, and fails there if it fails)
        return False
    return isinstance(first, (list, tuple)) or (isinstance(first, torch.Tensor) and first.ndim > 0)


def samplers_of(loader: DataLoader) -> list[Any]:
    """The loader's sampler and batch sampler, and the samplers they wrap (each once)."""
    found: list[Any] = []
    for s in (loader.sampler, loader.batch_sampler):
        for t in (s, getattr(s, "sampler", None)):
            if t is not None and all(t is not f for f in found):
                found.append(t)
    return found


def element_order(loader: DataLoader) -> tuple[BatchSampler | None, Any]:
    """``(lists, inner)``: ``lists`` is a BatchSampler passed as ``sampler=`` with ``batch_size=None``
    (the dataset reads a list of indices at a time, each element a ready-made batch), else None;
    ``inner`` the sampler whose order the items follow (that BatchSampler's, torch's BatchSampler's
    (``batch_sampler=BatchSampler(...)``), else the loader's)."""
    if loader.batch_sampler is None and isinstance(loader.sampler, BatchSampler):
        return loader.sampler, loader.sampler.sampler
    if type(loader.batch_sampler) is BatchSampler:
        return None, loader.batch_sampler.sampler
    return None, loader.sampler

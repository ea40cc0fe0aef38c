"""Evaluation loaders: what the user passes (Datasets, DataLoaders, dicts of them) as in-order
loaders of every item once, a disjoint unpadded share per rank; a sampler of the user's gives
the items evaluated (``docs/data.md``, "What evaluation takes from a sampler of yours")."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
)

from lightlike.data.checked import CheckedDataset, DefaultCollate
from lightlike.data.hf_datasets import loader_inputs
from lightlike.data.iterable import ShardedIterable
from lightlike.data.loader_info import (
    already_split,
    batching,
    check_nonempty,
    element_order,
    known_order,
    loader_like,
    yields_lists,
)
from lightlike.data.sampler import EveryNth, ResumableSampler
from lightlike.data.workers import end_with_parent
from lightlike.errors import DataError

log = logging.getLogger("lightlike")


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
    module: Any = None,
    remove_unused_columns: bool = True,
) -> DataLoader:
    """In-order loader; on several ranks each takes a disjoint, unpadded share. It has its own
    generator: starting an iterator must not draw from the global RNG (that would perturb the
    training run's dropout stream every time it evaluates).

    A DataLoader of the user's is used as it is on one process; on several it is rebuilt over
    the same dataset and settings with this split (``_split_eval_loader``), unless it already
    has one (an in-order ``ResumableSampler`` of this rank, or an IterableDataset with
    ``shards_itself = True``)."""
    if isinstance(data, DataLoader):  # one process or many: the same items, in the same order
        if already_split(data, for_eval=True, rank=rank, world_size=world_size):
            return data
        if world_size > 1 or _eval_changes(data):
            return _split_eval_loader(data, batch_size=batch_size, rank=rank, world_size=world_size, name=name)
        return data
    if not isinstance(data, Dataset) and not hasattr(data, "__getitem__"):
        raise DataError(f"{name} data of type {type(data).__name__} is neither a Dataset nor a DataLoader")
    inputs = loader_inputs(data, module, what=name, num_workers=num_workers, training=False,
                           remove_unused_columns=remove_unused_columns)
    data, num_workers, collate_fn = inputs.data, inputs.num_workers, collate_fn or inputs.collate_fn
    if isinstance(data, IterableDataset):
        if (world_size > 1 or num_workers > 1) and not inputs.shards_itself:
            data = ShardedIterable(data, rank, world_size, block=batch_size)  # each item once, in order
        return DataLoader(data, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                          pin_memory=pin_memory, generator=torch.Generator(),
                          worker_init_fn=end_with_parent(None, num_workers))
    n = check_nonempty(data, name)
    assert n is not None
    sampler = ResumableSampler(n, shuffle=False, rank=rank, world_size=world_size)
    return DataLoader(CheckedDataset(data, name), batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, collate_fn=collate_fn or DefaultCollate(name),
                      generator=torch.Generator(), worker_init_fn=end_with_parent(None, num_workers))


def normalise_eval_sets(data: Any, default_name: str = "val") -> dict[str, Any]:
    """``None`` → {}, a mapping → itself, anything else → ``{default_name: data}``."""
    if data is None:
        return {}
    if isinstance(data, Mapping):
        for k in data:
            if not isinstance(k, str) or not k or "/" in k:
                raise DataError(f"evaluation set names must be non-empty strings without '/', got {k!r}")
            if k == "train":  # its keys would mix with the training loss's (train/loss)
                raise DataError("an evaluation set may not be named 'train' (its train/loss would mix with the "
                                "training loss): name it e.g. 'train_eval'")
        return dict(data)
    return {default_name: data}


def _eval_changes(loader: DataLoader, batch_size: int | None = None, world_size: int = 1) -> list[str]:
    """What evaluation changes in a DataLoader of the user's: every element its sampler gives is
    evaluated once, in the sampler's order (a shuffling torch sampler's items in their order)."""
    own, drop_last, custom = batching(loader)
    iterable = isinstance(loader.dataset, IterableDataset)
    changes = []
    if custom:  # its own drop_last applies on any number of processes: it is read as it is
        if world_size > 1 and not iterable:
            size = own if own is not None else batch_size
            changes.append(f"its batch_sampler ({type(loader.batch_sampler).__name__}) is read once and its indices "
                           f"dealt in its order, in batches of {size} (it must give the same on every process)")
    elif drop_last:
        changes.append("drop_last is ignored (evaluation counts every item once)")
    if iterable and loader.num_workers > 1 and not already_split(loader):  # each worker would yield the whole stream
        changes.append(f"its IterableDataset is split over its {loader.num_workers} workers (each item once, in order)")
    if iterable or custom:
        return changes
    lists, inner = element_order(loader)
    if lists is not None and lists.drop_last:
        changes.append("its BatchSampler's drop_last is ignored (evaluation counts every item once)")
    if lists is not None:
        what = "BatchSampler's sampler"
    else:
        what = "batch_sampler's sampler" if loader.batch_size is None and loader.batch_sampler is not None else "sampler"
    order = known_order(inner)
    if order is None:  # the user's own sampler: as it is on one process
        if world_size > 1:
            kind = "index lists (whole batches)" if lists is not None or yields_lists(inner) else "elements"
            changes.append(f"its {what} ({type(inner).__name__}) is read once and its {kind} dealt in its order "
                           "(it must give the same on every process)")
    elif not _in_order(inner):
        whose = "its indices in the order given" if isinstance(order, list) else "an in-order one"
        changes.append(f"its {what} ({type(inner).__name__}) is replaced by {whose} (its {len(order)} items each "
                       "once; predictions come back in that order)")
    return changes


def _in_order(sampler: Any) -> bool:
    """Whether ``sampler`` gives its ``known_order`` as it is."""
    return type(sampler) is SequentialSampler or (type(sampler) is ResumableSampler and not sampler.shuffle
                                                   and sampler.world_size == 1 and sampler.start == 0)


def _read_once(sampler: Any) -> list[Any]:
    """The elements of one pass of a sampler of the user's, drawn with torch's global generator
    seeded alike on every rank and left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)  # the CPU's alone: a GPU's stream is left alone
        return list(sampler)


def _split_eval_loader(loader: DataLoader, *, batch_size: int, rank: int, world_size: int, name: str) -> DataLoader:
    own, _, custom = batching(loader)
    size = own if own is not None or not custom else batch_size
    iterable = isinstance(loader.dataset, IterableDataset)
    if changes := _eval_changes(loader, batch_size, world_size):
        how = f"split over {world_size} processes" if world_size > 1 else "rebuilt for evaluation"
        log.warning("the %s DataLoader is %s: %s", name, how, "; ".join(changes))
    if iterable:
        dataset: Any = ShardedIterable(loader.dataset, rank, world_size, block=size or 1)  # type: ignore[arg-type]
        sampler: Any = None
    else:
        dataset = loader.dataset
        check_nonempty(dataset, name)
        lists, inner = element_order(loader)
        order: Any = None if custom else known_order(inner)
        if custom:  # its batches' indices, in its order, dealt one by one as items are
            order = [i for batch in _read_once(loader.batch_sampler) for i in batch]
        elif order is None and lists is not None:  # index lists of the user's order: dealt whole
            order, lists = _read_once(lists), None
        elif order is None:  # the user's sampler: its elements (indices or index lists) as it gives them
            order = _read_once(inner)
        if lists is not None:  # index lists, in order, dealt whole
            sampler = BatchSampler(order, lists.batch_size, drop_last=False)
            sampler = sampler if world_size == 1 else EveryNth(sampler, rank, world_size)
        elif isinstance(order, range) and order.start == 0:
            sampler = ResumableSampler(len(order), shuffle=False, rank=rank, world_size=world_size)
        else:
            sampler = EveryNth(order, rank, world_size)
    return loader_like(loader, dataset, sampler, size, False, torch.Generator(), in_order=True)

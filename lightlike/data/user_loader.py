"""A training DataLoader of the user's made resumable mid-epoch, and what is said about it at set-up.

A loader whose sampler has a known meaning (``RandomSampler`` without replacement,
``SequentialSampler``, a ``DistributedSampler`` built for this job that does not pad) is rebuilt over the same dataset
with lightlike's ``ResumableSampler`` of that meaning, keeping its batching, collate_fn, workers and
memory settings: a resume seeks in O(1). Any other map-style loader resumes by reading the epoch's
first batches again (the HF Trainer's ``skip_first_batches``), unless its sampler draws from a
generator of its own, whose state a checkpoint does not hold: such a fit is said, at set-up, to
resume only from an epoch's end.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightlike.data.loader_info import batching, loader_like, samplers_of
from lightlike.data.sampler import ResumableSampler

log = logging.getLogger("lightlike")


def plain_shuffle(loader: DataLoader) -> bool | None:
    """The user's sampler as a shuffle flag: True for a plain RandomSampler, False for a
    SequentialSampler, None for anything else (whose meaning lightlike's sampler does not have)."""
    s = loader.sampler
    if type(loader.batch_sampler) is BatchSampler and loader.batch_size is None:  # batch_sampler=BatchSampler(...)
        s = loader.batch_sampler.sampler
    if type(s) is SequentialSampler:
        return False
    if type(s) is RandomSampler and not s.replacement and s.num_samples == len(s.data_source):  # type: ignore[arg-type]
        return True
    return None


def resumable_sampler(loader: DataLoader, *, seed: int, world_size: int) -> ResumableSampler | None:
    """A ``ResumableSampler`` with the meaning of ``loader``'s sampler, or None where there is none:
    a plain RandomSampler (shuffled by ``seed``, each item once), a SequentialSampler, a
    DistributedSampler for this job's ``world_size`` that does not pad (the same order, with its own
    seed, shuffle and rank)."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
        return None  # a subclass may do more than its arguments say
    batch_size, _, custom = batching(loader)
    if custom or (batch_size is None and loader.batch_sampler is None):  # its own batches
        return None
    n = len(loader.dataset)  # type: ignore[arg-type]
    shuffle = plain_shuffle(loader)
    if shuffle is not None:
        return ResumableSampler(n, shuffle=shuffle, seed=seed, world_size=1, even=True) if world_size == 1 else None
    inner = [s for s in samplers_of(loader) if type(s) is DistributedSampler]
    if len(inner) == 1 and inner[0].num_replicas == world_size and len(inner[0].dataset) == n:  # type: ignore[arg-type]
        d = inner[0]  # (one that pads, repeating items, is kept: lightlike's never repeats one)
        if d.drop_last or n % world_size == 0:  # then the same order, item for item
            return ResumableSampler(n, shuffle=d.shuffle, seed=d.seed, rank=d.rank, world_size=world_size, even=True)
    return None


def seekable_loader(loader: DataLoader, *, seed: int, world_size: int) -> DataLoader:
    """``loader`` rebuilt with a ``ResumableSampler`` of its sampler's meaning
    (``resumable_sampler``), or ``loader`` itself where its sampler has no such meaning."""
    sampler = resumable_sampler(loader, seed=seed, world_size=world_size)
    if sampler is None:
        return loader
    batch_size, drop_last, _ = batching(loader)
    was = type(next(s for s in samplers_of(loader) if not hasattr(s, "batch_size"))).__name__
    log.info("the training DataLoader's %s is replaced by lightlike's ResumableSampler (shuffle=%s, seed=%d): the "
             "same kind of order, which a mid-epoch resume seeks in; batch_size=%s, collate_fn and workers are kept",
             was, sampler.shuffle, sampler.seed, batch_size)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return loader_like(loader, loader.dataset, sampler, batch_size, drop_last, generator)


def own_generator(loader: DataLoader) -> str | None:
    """The name of a sampler of ``loader`` that draws from a ``torch.Generator`` of its own (whose
    state a checkpoint does not hold, so an epoch's order cannot be read again), or None."""
    for s in samplers_of(loader):
        if isinstance(getattr(s, "generator", None), torch.Generator):
            return type(s).__name__
    return None


def say_how_it_resumes(loader: DataLoader, config_batch_size: int) -> None:
    """At set-up, before step 1: which batch_size wins (the DataLoader's: a warning where the
    Fitter's is not the default), and how a mid-epoch checkpoint of a loader lightlike did not
    rebuild resumes."""
    from lightlike.config import FitConfig

    batch_size = batching(loader)[0]
    if batch_size is not None and batch_size != config_batch_size:
        level = logging.WARNING if config_batch_size != FitConfig.batch_size else logging.INFO
        log.log(level, "the training DataLoader's batch_size=%d is used, not the Fitter's batch_size=%d (which "
                "applies to a Dataset passed to fit, and is the evaluation batch size unless eval_batch_size is "
                "set): build the DataLoader with the batch size you want", batch_size, config_batch_size)
    if isinstance(loader.dataset, IterableDataset) or isinstance(loader.sampler, ResumableSampler):
        return
    named = own_generator(loader)
    if named is not None:
        log.warning("this fit cannot resume mid-epoch: the training DataLoader's %s draws its order from a "
                    "torch.Generator of its own, whose state checkpoints do not hold. Its checkpoints resume from "
                    "an epoch's end (save_strategy='epoch'); pass the Dataset (or a DataLoader with shuffle=True) "
                    "for mid-epoch resumes", named)
    else:
        log.info("the training DataLoader's sampler (%s) cannot seek: a mid-epoch resume reads the epoch's batches "
                 "up to its checkpoint again (not trained on); pass the Dataset (or a DataLoader with shuffle=True "
                 "or False) to resume without reading them", type(loader.sampler).__name__)

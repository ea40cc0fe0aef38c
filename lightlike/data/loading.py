"""Turning what the user passes (Datasets or DataLoaders) into the loaders the loop reads."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightlike.data.iterable import ShardedIterable
from lightlike.data.sampler import EveryNth, ResumableSampler
from lightlike.data.workers import end_with_parent, start_workers
from lightlike.errors import ConfigError, DataError

log = logging.getLogger("lightlike")


@dataclass
class TrainData:
    """The training loader plus what the loop needs to know about it."""

    loader: DataLoader
    sampler: ResumableSampler | None  # None: the user's own DataLoader or an IterableDataset
    num_samples: int | None  # samples per epoch (global), when known
    seed: int
    generator: torch.Generator | None
    world_size: int = 1
    #: set when the ranks' shares may differ (``agree_on_length``): the smallest over the ranks,
    #: and whether a flag is set on any rank
    min_over_ranks: Callable[[int], int] | None = None
    any_over_ranks: Callable[[bool], bool] | None = None

    @property
    def deals_evenly(self) -> bool:
        """Whether every rank takes the same batches each epoch without agreeing on it: a sampler
        that deals evenly (lightlike's); not an IterableDataset or a sampler of the user's."""
        return self.sampler is not None and self.sampler.deals_evenly

    def agree_on_length(self, strategy: Any) -> None:
        """The ranks' shares may differ: an epoch with a length lasts the shortest share's batches on
        every rank (one all-reduce per epoch); one without ends when a rank runs out, which the loop
        agrees on every step. Collective."""
        self.min_over_ranks = lambda n: int(strategy.all_reduce(torch.tensor(n, device=strategy.root_device), "min"))
        self.any_over_ranks = strategy.reduce_flag

    def replays(self) -> bool:
        """Whether a mid-epoch resume reaches its position by reading the epoch's first batches
        again (an IterableDataset cannot seek); map-style data seeks through its sampler."""
        return self.sampler is None and isinstance(self.loader.dataset, IterableDataset)

    def order_key(self) -> dict[str, Any] | None:
        """What, besides (seed, epoch), the epoch's batches depend on; saved with a checkpoint so
        that a mid-epoch resume refuses an order that would repeat and skip samples."""
        sampler = self.sampler
        if sampler is not None:
            return {"seed": sampler.seed, "shuffle": sampler.shuffle, **(sampler.order_key() or {})}
        if self.replays():  # each rank's batches depend on how the items are dealt
            loader = self.loader
            return {"batch_size": loader.batch_size or 1, "num_workers": loader.num_workers,
                    "world_size": self.world_size, "drop_last": loader.drop_last}
        # a sampler of the user's that cannot seek: its order is nobody else's (on several
        # processes lightlike's sampler replaces it, whose position would mean other samples)
        return {"sampler": type(getattr(self.loader, "sampler", None)).__name__}

    def batches_per_epoch(self) -> int | None:
        """This rank's batches in the epoch (the shortest rank's when the shares may differ)."""
        try:
            n = self.own_batches()
        except TypeError:
            return None
        return self.min_over_ranks(n) if self.min_over_ranks is not None else n

    def own_batches(self) -> int:
        """This rank's batches in the epoch (``TypeError`` when unknown): ``len()`` of the loader,
        counted per worker shard for an IterableDataset lightlike shards."""
        dataset = self.loader.dataset
        if isinstance(dataset, ShardedIterable):
            return dataset.batches(self.loader.batch_size or 1, self.loader.drop_last, self.loader.num_workers)
        return len(self.loader)

    def step_budget(self, max_steps: int | None, max_epochs: int | None, accum: int,
                    resumed: Any = None) -> tuple[int, float]:
        """(optimizer steps to take, epochs to stop after): ``max_steps`` wins; epochs are counted
        too when only ``max_epochs`` is set (``should_epoch_stop`` ends one early). ``resumed``:
        the ``FitState`` of the checkpoint a run resumes from."""
        batches = self.batches_per_epoch()
        sampler = self.sampler
        if batches == 0 and sampler is not None and sampler.world_size > 1 and sampler.n < sampler.world_size:
            raise DataError(f"the training data has {sampler.n} item(s) for {sampler.world_size} processes: each "
                            "epoch leaves out the tail that does not split evenly over the processes, here every "
                            f"item; pass at least {sampler.world_size} items, or run on fewer processes")
        if batches == 0:
            raise DataError("the training data gives no batch per epoch (an empty DataLoader, or drop_last=True "
                            "with fewer items than batch_size): pass more data or a smaller batch_size")
        if max_steps is not None:
            return max_steps, math.inf
        if batches is None:
            raise ConfigError("the training data has no length (IterableDataset): set max_steps")
        per_epoch = -(-batches // accum)
        total = max_epochs * per_epoch  # type: ignore[operator]
        if resumed is None or resumed.max_steps == total:
            return total, max_epochs  # type: ignore[return-value]
        # the epochs' steps changed since the checkpoint (batch size, accumulation, world size,
        # data): what is left of the epochs is counted from where the run stands
        left = batches
        if self.sampler is not None and resumed.samples_in_epoch:
            self.sampler.set_epoch(resumed.epoch_index, resumed.samples_in_epoch)
            left = self.batches_per_epoch()  # type: ignore[assignment]
        rest = -(-left // accum) + (max_epochs - resumed.epoch_index - 1) * per_epoch  # type: ignore[operator]
        return resumed.global_step + max(0, rest), max_epochs  # type: ignore[return-value]

    def position(self, start: int, batches_in_epoch: int, world_size: int) -> EpochPosition:
        """The loop's position in the epoch whose iterator ``epoch_iterator`` just began at
        global sample ``start``."""
        return EpochPosition(self, start, batches_in_epoch, world_size)

    def epoch_iterator(self, epoch: int, start_sample: int = 0, start_batch: int = 0) -> Any:
        """An iterator over the batches of ``epoch`` beginning ``start_sample`` samples in (this
        rank's batch ``start_batch``, where an IterableDataset is read up to it)."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, start_sample)
        elif start_sample and self.replays():
            batches = self._fresh_iterator(epoch)
            log.warning("resuming mid-epoch in an IterableDataset, which cannot seek: reading the %d batch(es) "
                        "this process had taken of epoch %d again (not trained on). The continuation is exact "
                        "when the dataset yields the same items in the same order each time it is read",
                        start_batch, epoch)
            for taken in range(start_batch):
                if next(batches, None) is None:
                    raise DataError(f"resuming mid-epoch: epoch {epoch} of the IterableDataset ended after {taken} "
                                    f"batch(es), but the checkpoint was taken after {start_batch}: the dataset "
                                    "does not yield the same items when read again")
            return batches
        elif start_sample:
            raise DataError(
                "cannot resume mid-epoch: the training data is a DataLoader without lightlike's "
                "ResumableSampler as its sampler (one inside a BatchSampler is not followed); pass a map-style "
                "Dataset, or build the DataLoader with batch_size=... and a ResumableSampler as sampler=")
        else:  # e.g. a DistributedSampler, also inside a BatchSampler (batch_sampler= or sampler=)
            for sampler in _samplers_of(self.loader):
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
        return self._fresh_iterator(epoch)

    def _fresh_iterator(self, epoch: int) -> Any:
        if self.generator is not None:
            self.generator.manual_seed(self.seed + epoch)  # DataLoader worker seeds
            if getattr(self.loader, "persistent_workers", False) and getattr(self.loader, "_iterator", None) is not None:
                # a reused persistent iterator does not draw the base seed a fresh one draws before
                # its sampler shuffles: drawn here, so that an epoch's order does not depend on
                # whether the iterator is reused (a resumed run's first epoch starts a fresh one)
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            return start_workers(self.loader)
        # a DataLoader of the user's without generator= draws its workers' base seed from the
        # global generator as its iterator starts: at the epoch's start in one run, at the resume
        # point in a resumed one. Drawn here from (seed, epoch), outside training's random streams
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + epoch)
            return start_workers(self.loader)


class EpochPosition:
    """Where the loop is in an epoch, advanced once per optimizer step.

    Positions are global samples, counted from where the epoch's iterator began: batches are
    dealt round-robin from the global order, so after k batches per rank the position is
    ``start + k * batch_size * world_size``, capped at the epoch's end (the last batch may be
    short). Counting from the iterator's own start keeps the position right when a resumed run
    uses another batch size or world size. Everything the step needs comes from one call."""

    __slots__ = ("_start", "_here", "_batches", "_global_batch", "_end", "_done_below", "_per_epoch",
                 "_batches_per_epoch", "_agreed_left", "_ahead", "_any_rank", "follows", "_promised")

    def __init__(self, data: TrainData, start: int, batches_in_epoch: int, world_size: int):
        self._start, self._here, self._batches = start, 0, batches_in_epoch
        batch_size = data.loader.batch_size or 1
        self._global_batch = batch_size * world_size
        self._batches_per_epoch = data.batches_per_epoch() if data.sampler is None else None
        # shares that may differ by rank: the epoch ends at the same step everywhere, once every
        # rank has taken the shortest share's batches left from here (without a length, an empty
        # window, agreed by all ranks, ends it)
        self._agreed_left: int | None = None
        # an IterableDataset's own __len__: the epoch is planned on it, but the data may end
        # sooner (or go on longer): read one batch ahead, the epoch ends at whichever comes first
        self._promised = data.own_batches() if data.replays() and self._batches_per_epoch is not None else None
        if data.min_over_ranks is not None:
            self._agreed_left = left = self._batches_per_epoch if data.sampler is None else data.batches_per_epoch()
            own = data.own_batches() if left is not None else 0
            if left is not None and own > left:
                log.warning("this rank's share of the epoch holds %d batch(es) and another rank's %d: its last %d "
                            "are left out, so that every rank takes the same steps", own, left, own - left)
        sampler = data.sampler
        if sampler is not None:
            self._end: int | None = sampler.global_end()  # the rest from start splits evenly
            # no batch left once fewer than one sample per rank (or, with drop_last, fewer than
            # a whole batch per rank) remains
            self._done_below = self._global_batch if data.loader.drop_last else 1
            n = sampler.n
            self._per_epoch = n - n % sampler.world_size if sampler.drop_last else n
        else:
            self._end, self._done_below, self._per_epoch = data.num_samples, 0, 0
        self._ahead: Lookahead | None = None
        self._any_rank = data.any_over_ranks
        #: every rank has another batch (read ahead, agreed): the next window needs no agreement
        self.follows = False

    def watch(self, batches: Any) -> Any:
        """The epoch's batches, read one ahead where the epoch's length is unknown (an
        IterableDataset): ``advance`` then knows that a step took the epoch's last batch, and the
        epoch ends at that step's boundary, before its checkpoint, as a sized epoch does (else it
        ended at the next, empty, window: its evaluation came after the checkpoint, so a run
        resumed from it evaluated and logged that step again)."""
        left = self._agreed_left
        if self._promised is not None or not (self._per_epoch or self._batches_per_epoch is not None or left is not None):
            batches = self._ahead = Lookahead(batches)  # (it peeks past the cap below)
        cap = left if left is not None else self._promised  # (an IterableDataset's own __len__)
        if cap is not None:  # a longer share (or stream) stops at the cap, in every window too
            batches = itertools.islice(batches, max(0, cap - (self._batches if self._per_epoch == 0 else 0)))
        return batches

    def advance(self, batches: int) -> tuple[int, float, bool]:
        """After a step that took ``batches`` batches on each rank: (global samples consumed in
        the epoch, the fraction of the epoch done, whether the epoch has no batch left; False
        where that is unknown, and an empty accumulation window then ends the epoch)."""
        self._here += batches
        self._batches += batches
        samples = self._start + self._here * self._global_batch
        end = self._end
        if end is not None and samples > end:
            samples = end
        if self._per_epoch:  # lightlike's sampler
            assert end is not None
            fraction, done = min(1.0, samples / self._per_epoch), end - samples < self._done_below
        else:
            per_epoch = self._batches_per_epoch
            fraction = min(1.0, self._batches / per_epoch) if per_epoch else 0.0
            done = per_epoch is not None and per_epoch > 0 and self._batches >= per_epoch
        left = self._agreed_left
        if self._promised is not None:  # an IterableDataset's __len__: agreed, or the data, ends it
            assert self._ahead is not None
            ended = self._ahead.ended()
            reached = self._batches >= (left if left is not None else self._promised)
            if ended and self._batches < self._promised:
                log.warning("the training data's length promised %d batch(es) of this epoch to this process and it "
                            "ended after %d: the schedule and the epoch count are planned on its __len__, so make "
                            "__len__ return the number of items it yields", self._promised, self._batches)
            elif reached and not ended and self._batches >= self._promised:
                log.warning("the training data yields more than the %d batch(es) of this epoch its __len__ promised to "
                            "this process: the epoch ends there (the rest is not trained on); make __len__ return "
                            "the number of items it yields", self._promised)
            done = reached or ended
            done = self._any_rank(done) if self._any_rank is not None else done
            self.follows = not done
        elif left is not None:
            done = self._here >= left
        elif self._ahead is not None:
            ended = self._ahead.ended()
            done = self._any_rank(ended) if self._any_rank is not None else ended
            if done and not ended:
                log.warning("another rank ran out of training data: skipping the rest of this rank's share "
                            "of the epoch")
            self.follows = not done
        return samples, fraction, done


class Lookahead:
    """An iterator that reads one item ahead when asked whether another follows."""

    __slots__ = ("_it", "_next")
    _EMPTY = object()

    def __init__(self, it: Any):
        self._it, self._next = iter(it), Lookahead._EMPTY

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        item = self._next
        if item is Lookahead._EMPTY:
            return next(self._it)
        self._next = Lookahead._EMPTY
        return item

    def ended(self) -> bool:
        if self._next is Lookahead._EMPTY:
            self._next = next(self._it, Lookahead._EMPTY)
        return self._next is Lookahead._EMPTY


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
        if world_size > 1 and not _already_split(data, world_size=world_size):
            data = _split_train_loader(data, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        sampler = data.sampler if isinstance(data.sampler, ResumableSampler) else None
        grouped = getattr(sampler, "batch_size", None)  # a LengthGroupedSampler's runs are its batches
        if grouped is not None and data.batch_size != grouped:
            raise DataError(f"the DataLoader's batch_size={data.batch_size} differs from its LengthGroupedSampler's "
                            f"batch_size={grouped}: its batches would not line up with the sampler's groups (and a "
                            "resume would repeat and skip items); build both with the same batch_size")
        n = sampler.n if sampler is not None else None
        return TrainData(data, sampler, n, seed, data.generator, world_size)
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
                            pin_memory=pin_memory, collate_fn=collate_fn, generator=generator,
                            worker_init_fn=end_with_parent(None, num_workers))
        return TrainData(loader, None, None, seed, generator, world_size)
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
                        generator=generator, worker_init_fn=end_with_parent(None, num_workers))
    return TrainData(loader, sampler, n, seed, generator, world_size)


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
    training run's dropout stream every time it evaluates).

    A DataLoader of the user's is used as it is on one process; on several it is rebuilt over
    the same dataset and settings with this split (``_split_eval_loader``), unless it already
    has one (an in-order ``ResumableSampler`` of this rank, or an IterableDataset with
    ``shards_itself = True``)."""
    if isinstance(data, DataLoader):  # one process or many: the same items, in the same order
        if world_size > 1 and not _already_split(data, for_eval=True, rank=rank, world_size=world_size) \
                or world_size == 1 and _eval_changes(data):
            return _split_eval_loader(data, batch_size=batch_size, rank=rank, world_size=world_size, name=name)
        return data
    if not isinstance(data, Dataset) and not hasattr(data, "__getitem__"):
        raise DataError(f"{name} data of type {type(data).__name__} is neither a Dataset nor a DataLoader")
    if isinstance(data, IterableDataset):
        if (world_size > 1 or num_workers > 1) and not getattr(data, "shards_itself", False):
            data = ShardedIterable(data, rank, world_size, block=batch_size)  # each item once, in order
        return DataLoader(data, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                          pin_memory=pin_memory, generator=torch.Generator(),
                          worker_init_fn=end_with_parent(None, num_workers))
    n = _check_nonempty(data, name)
    assert n is not None
    sampler = ResumableSampler(n, shuffle=False, rank=rank, world_size=world_size)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, collate_fn=collate_fn, generator=torch.Generator(),
                      worker_init_fn=end_with_parent(None, num_workers))


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


# -- a DataLoader of the user's, on several processes ----------------------------------------------
# Like Lightning's use_distributed_sampler and Accelerate's prepare: the loader is rebuilt over
# the same dataset with the same settings and lightlike's split, so every rank takes its own
# share instead of the whole set.


def _batching(loader: DataLoader) -> tuple[int | None, bool, bool]:
    """``(batch_size, drop_last, custom)``: ``custom`` when the loader has a batch_sampler of the
    user's, whose own ``batch_size``/``drop_last`` are read when it has them."""
    bs = loader.batch_sampler
    if bs is None or (type(bs) is BatchSampler and loader.batch_size is not None):  # torch's own batching
        return loader.batch_size, bool(loader.drop_last), False
    if type(bs) is BatchSampler:  # a plain BatchSampler passed as batch_sampler=: its settings are kept
        return bs.batch_size, bool(bs.drop_last), False
    size = getattr(bs, "batch_size", None)
    return (size if isinstance(size, int) else None), bool(getattr(bs, "drop_last", False)), True


def _already_split(loader: DataLoader, *, for_eval: bool = False, rank: int = 0, world_size: int = 1) -> bool:
    """Whether the user's loader already gives this rank its own share."""
    if isinstance(loader.dataset, IterableDataset):
        return bool(getattr(loader.dataset, "shards_itself", False)) or isinstance(loader.dataset, ShardedIterable)
    sampler = loader.sampler
    if for_eval:  # only what lightlike would build itself: in order, unpadded, this rank's
        return (type(sampler) is ResumableSampler and not sampler.shuffle and not sampler.drop_last
                and sampler.start == 0 and (sampler.rank, sampler.world_size) == (rank, world_size)
                and _batching(loader)[1:] == (False, False))
    # also a sampler inside a BatchSampler (batch_sampler=, or sampler= for ready-made batches)
    for s in _samplers_of(loader):
        if isinstance(s, ResumableSampler) and s.world_size != world_size:
            raise DataError(f"the training DataLoader's {type(s).__name__} has world_size={s.world_size} but the "
                            f"job runs {world_size} processes: build it with rank=..., world_size=... of this job "
                            "(or pass the Dataset and let the Fitter split it)")
        if isinstance(s, (ResumableSampler, DistributedSampler)):
            return True
    return False


def _loader_like(loader: DataLoader, dataset: Any, sampler: Any, batch_size: int | None, drop_last: bool,
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


def _plain_sampler(loader: DataLoader) -> bool | None:
    """The user's sampler as a shuffle flag: True for a plain RandomSampler, False for a
    SequentialSampler, None for anything else (which cannot be kept)."""
    s = loader.sampler
    if type(loader.batch_sampler) is BatchSampler and loader.batch_size is None:  # batch_sampler=BatchSampler(...)
        s = loader.batch_sampler.sampler
    if type(s) is SequentialSampler:
        return False
    if type(s) is RandomSampler and not s.replacement and s._num_samples is None:
        return True
    return None


def _split_train_loader(loader: DataLoader, *, shuffle: bool, seed: int, rank: int, world_size: int) -> DataLoader:
    batch_size, drop_last, custom = _batching(loader)
    generator = torch.Generator()
    generator.manual_seed(seed)
    if isinstance(loader.dataset, IterableDataset):
        log.info("the training DataLoader's IterableDataset is sharded over %d processes (set shards_itself = True "
                 "on a dataset that shards itself)", world_size)
        return _loader_like(loader, ShardedIterable(loader.dataset, rank, world_size), None, batch_size, drop_last,
                            generator)
    if loader.batch_sampler is None and isinstance(loader.sampler, BatchSampler):  # it yields index lists
        raise DataError(f"cannot split the training DataLoader over {world_size} processes: it reads ready-made "
                        "batches (batch_size=None) through a BatchSampler passed as sampler=, whose index lists "
                        "lightlike cannot deal out. Pass the dataset with batch_size=... (items read one by one: "
                        "split, shuffled and resumable mid-epoch by lightlike), or build that BatchSampler over a "
                        "sampler split for this job's ranks: sampler=BatchSampler(DistributedSampler(dataset, "
                        "num_replicas=WORLD_SIZE, rank=RANK), batch_size, drop_last) (that one resumes only at "
                        "epoch ends)")
    if custom and batch_size is None:
        raise DataError(f"cannot split the training DataLoader over {world_size} processes: its batch_sampler "
                        f"({type(loader.batch_sampler).__name__}) has no batch_size to keep. Pass the Dataset, a "
                        "DataLoader with batch_size=..., or one whose sampler is a ResumableSampler (or "
                        "DistributedSampler) built for this job's ranks")
    # a batch_sampler of the user's is replaced whole: the Fitter's shuffle decides (the loader's
    # sampler is then torch's placeholder SequentialSampler, not the user's choice)
    shuffled = None if custom else _plain_sampler(loader)
    if custom or shuffled is None:
        what = f"batch_sampler ({type(loader.batch_sampler).__name__})" if custom else \
            f"sampler ({type(loader.sampler).__name__})"
        log.warning("the training DataLoader's %s cannot be split over %d processes: it is replaced by lightlike's "
                    "ResumableSampler (shuffle=%s, seed=%d, batch_size=%s). To keep your own, give it a "
                    "ResumableSampler or DistributedSampler built for this job's ranks", what, world_size,
                    shuffle if shuffled is None else shuffled, seed, batch_size)
    n = len(loader.dataset)  # type: ignore[arg-type]
    if drop_last and batch_size and n // world_size < batch_size:
        raise DataError(f"drop_last=True with batch_size={batch_size} leaves no batch of the {n} training items "
                        f"on {world_size} processes; lower batch_size or set drop_last=False")
    if n % world_size:
        log.warning("%d training items do not split evenly over %d processes: %d item(s) of each epoch's "
                    "shuffled order are left out so every process takes the same number of steps",
                    n, world_size, n % world_size)
    sampler = ResumableSampler(n, shuffle=shuffle if shuffled is None else shuffled, seed=seed, rank=rank,
                               world_size=world_size, even=True)
    return _loader_like(loader, loader.dataset, sampler, batch_size, drop_last, generator)


def _eval_changes(loader: DataLoader, batch_size: int | None = None) -> list[str]:
    """What evaluation changes in a DataLoader of the user's: every item once, in dataset order."""
    own, drop_last, custom = _batching(loader)
    changes = []
    if custom:
        size = own if own is not None else batch_size
        changes.append(f"its batch_sampler ({type(loader.batch_sampler).__name__}) is replaced by batches of {size}")
    if drop_last:
        changes.append("drop_last is ignored (evaluation counts every item once)")
    if isinstance(loader.dataset, IterableDataset) and loader.num_workers > 1 \
            and not _already_split(loader):  # each worker would yield the whole stream
        changes.append(f"its IterableDataset is split over its {loader.num_workers} workers (each item once, in order)")
    lists, inner = _element_order(loader)
    if lists is not None and lists.drop_last:
        changes.append("its BatchSampler's drop_last is ignored (evaluation counts every item once)")
    if not isinstance(loader.dataset, IterableDataset) and type(inner) is not SequentialSampler:
        what = "sampler" if lists is None else "BatchSampler's sampler"
        changes.append(f"its {what} ({type(inner).__name__}) is replaced by an in-order one "
                       "(predictions come back in dataset order)")
    return changes


def _samplers_of(loader: DataLoader) -> list[Any]:
    """The loader's sampler and batch sampler, and the samplers they wrap (each once)."""
    found: list[Any] = []
    for s in (loader.sampler, loader.batch_sampler):
        for t in (s, getattr(s, "sampler", None)):
            if t is not None and all(t is not f for f in found):
                found.append(t)
    return found


def _element_order(loader: DataLoader) -> tuple[BatchSampler | None, Any]:
    """``(lists, inner)``: ``lists`` is a BatchSampler passed as ``sampler=`` with ``batch_size=None``
    (the dataset reads a list of indices at a time, each element a ready-made batch), else None;
    ``inner`` the sampler whose order the items follow (that BatchSampler's, else the loader's)."""
    if loader.batch_sampler is None and isinstance(loader.sampler, BatchSampler):
        return loader.sampler, loader.sampler.sampler
    return None, loader.sampler


def _split_eval_loader(loader: DataLoader, *, batch_size: int, rank: int, world_size: int, name: str) -> DataLoader:
    own, _, custom = _batching(loader)
    size = own if own is not None or not custom else batch_size
    iterable = isinstance(loader.dataset, IterableDataset)
    if changes := _eval_changes(loader, batch_size):
        how = f"split over {world_size} processes" if world_size > 1 else "rebuilt for evaluation"
        log.warning("the %s DataLoader is %s: %s", name, how, "; ".join(changes))
    if iterable:
        dataset: Any = ShardedIterable(loader.dataset, rank, world_size, block=size or 1)  # type: ignore[arg-type]
        sampler: Any = None
    else:
        dataset = loader.dataset
        n = _check_nonempty(dataset, name)
        assert n is not None
        lists, inner = _element_order(loader)
        if type(inner) is SequentialSampler:  # kept as it is on one process: the same items on several
            n = len(inner)
        sampler = ResumableSampler(n, shuffle=False, rank=rank, world_size=world_size)
        if lists is not None:  # index lists, in order, dealt whole
            sampler = BatchSampler(SequentialSampler(range(n)), lists.batch_size, drop_last=False)
            sampler = sampler if world_size == 1 else EveryNth(sampler, rank, world_size)
    return _loader_like(loader, dataset, sampler, size, False, torch.Generator(), in_order=True)


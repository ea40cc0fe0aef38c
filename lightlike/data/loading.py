"""Turning what the user passes (Datasets or DataLoaders) into the loaders the loop reads."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
)

from lightlike.data.checked import CheckedDataset, DefaultCollate
from lightlike.data.hf_datasets import loader_inputs, set_dataset_epoch
from lightlike.data.iterable import ShardedIterable
from lightlike.data.loader_info import (
    already_split,
    batch_items,
    batching,
    check_nonempty,
    loader_like,
    samplers_of,
    yields_lists,
)
from lightlike.data.position import EpochPosition
from lightlike.data.sampler import ResumableSampler
from lightlike.data.user_loader import own_generator, plain_shuffle, say_how_it_resumes, seekable_loader
from lightlike.data.workers import end_with_parent, start_workers
from lightlike.errors import ConfigError, DataError

log = logging.getLogger("lightlike")
_END = object()


def epoch_steps(epochs: float, per_epoch: int, less: int = 0) -> int:
    """``ceil((epochs - less) * per_epoch)``: the optimizer steps of ``epochs`` epochs (2.5
    epochs of 5 steps: 13, the HF Trainer's count for ``num_train_epochs=2.5``), less ``less``
    whole epochs (negative within the last, fractional one), computed on the decimal the user
    wrote (``repr``), so that 2.2 epochs of 25 steps are 55, not the 56 of the binary float's
    55.00000000000001 (nor 2.3 - 2 the 0.2999...8)."""
    return math.ceil((Fraction(repr(float(epochs))) - less) * per_epoch)


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
    #: and the sums over the ranks of a few ints (one all-reduce)
    min_over_ranks: Callable[[int], int] | None = None
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None
    #: the user's DataLoader (its batch_size, not the Fitter's, is the one trained with)
    from_user: bool = False
    #: ``limit_train_batches``: the micro-batches each epoch takes on every rank (None: all)
    batch_limit: int | None = None

    @property
    def deals_evenly(self) -> bool:
        """Whether every rank takes the same batches each epoch without agreeing on it: a sampler
        that deals evenly (lightlike's); not an IterableDataset or a sampler of the user's."""
        return self.sampler is not None and self.sampler.deals_evenly

    def agree_on_length(self, strategy: Any) -> None:
        """The ranks' shares may differ: an epoch with a length lasts the shortest share's batches on
        every rank (one all-reduce per epoch); one without ends when a rank runs out, which the loop
        agrees on every step. Collective."""
        device = strategy.root_device
        self.min_over_ranks = lambda n: int(strategy.collectives.all_reduce(torch.tensor(n, device=device), "min"))
        self.sum_over_ranks = strategy.collectives.sum_floats

    def replays(self) -> bool:
        """Whether a mid-epoch resume reaches its position by reading the epoch's first batches
        again (an IterableDataset cannot seek); map-style data seeks through its sampler."""
        return self.sampler is None and isinstance(self.loader.dataset, IterableDataset)

    def reads_again(self) -> bool:
        """Whether a mid-epoch resume reads the epoch's first batches again: an IterableDataset, or a
        map-style DataLoader of the user's whose sampler cannot seek (``user_loader``)."""
        return self.sampler is None

    def order_key(self) -> dict[str, Any] | None:
        """What, besides (seed, epoch), the epoch's batches depend on; saved with a checkpoint so
        that a mid-epoch resume refuses an order that would repeat and skip samples."""
        sampler = self.sampler
        if sampler is not None:  # (a user's DataLoader's batch_size: named when it changed, see ``continues``)
            mine = {"batch_size": batch_items(self.loader)} if self.from_user else {}
            return {"seed": sampler.seed, "shuffle": sampler.shuffle, **(sampler.order_key() or {}), **mine}
        if self.replays():  # each rank's batches depend on how the items are dealt
            loader = self.loader
            return {"batch_size": loader.batch_size or 1, "num_workers": loader.num_workers,
                    "world_size": self.world_size, "drop_last": loader.drop_last}
        # a sampler of the user's that cannot seek: its order is nobody else's, read again in
        # batches of this size on each process
        return {"sampler": type(getattr(self.loader, "sampler", None)).__name__,
                "batch_size": batch_items(self.loader), "world_size": self.world_size}

    def continues(self, saved: Any) -> bool:
        """Whether this run's data continues the epoch of a checkpoint whose ``order_key`` was
        ``saved``: the same order; lightlike's sampler seeks by samples, so a DataLoader's changed
        batch_size continues it too (and is named among the changed settings)."""
        order = self.order_key()
        if self.sampler is not None and isinstance(saved, dict) and isinstance(order, dict):
            saved, order = ({k: v for k, v in d.items() if k != "batch_size"} for d in (saved, order))
        return saved == order

    def dataset_length(self) -> int | None:
        """``len()`` of the training dataset (for an IterableDataset lightlike shards, of the one it
        wraps); None when it has none. Kept in checkpoints: a mid-epoch resume on data of another
        length would continue an order over other items."""
        dataset = self.loader.dataset
        if isinstance(dataset, ShardedIterable):
            dataset = dataset.dataset
        try:
            return len(dataset)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):  # an IterableDataset without __len__
            return None

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

    def step_budget(self, max_steps: int | None, max_epochs: float | None, accum: int,
                    resumed: Any = None) -> tuple[int, float]:
        """(optimizer steps to take, epochs to stop after): ``max_steps`` wins; epochs are counted
        too when only ``max_epochs`` is set (``should_epoch_stop`` ends one early). ``resumed``:
        the ``FitState`` of the checkpoint a run resumes from."""
        if resumed is not None and resumed.samples_in_epoch:
            self.check_resumable_mid_epoch()
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
        batches = batches if self.batch_limit is None else min(batches or self.batch_limit, self.batch_limit)
        if batches is None:
            whole = float(max_epochs).is_integer()  # type: ignore[arg-type]
            raise ConfigError("the training data has no length (IterableDataset): set max_steps" + (
                "" if whole else f"; max_epochs={max_epochs!r} is a fraction of an epoch's optimizer steps, whose "
                "number is not known without the data's length"), settings=("max_epochs", "max_steps"))
        per_epoch = -(-batches // accum)
        total = epoch_steps(max_epochs, per_epoch)  # type: ignore[arg-type]  # (>= 1: max_epochs > 0)
        if resumed is None or resumed.max_steps == total:
            return total, max_epochs  # type: ignore[return-value]
        # the epochs' steps changed since the checkpoint (batch size, accumulation, world size,
        # data): what is left of the epochs is counted from where the run stands
        left = batches
        if self.sampler is not None and resumed.samples_in_epoch:
            self.sampler.set_epoch(resumed.epoch_index, resumed.samples_in_epoch)
            left = self.batches_per_epoch()  # type: ignore[assignment]
        elif resumed.samples_in_epoch and self.reads_again():  # read again up to the position, not trained on
            # (mid-epoch the ranks have taken the same batches: a replay keeps the world size)
            left = max(0, batches - resumed.batches_in_epoch)
        if self.batch_limit is not None:
            left = max(0, min(left, self.batch_limit - resumed.batches_in_epoch))
        # (a fractional last epoch: the steps taken of it are counted as a negative rest of epochs)
        rest = -(-left // accum) + epoch_steps(max_epochs, per_epoch, resumed.epoch_index + 1)  # type: ignore[arg-type]
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
            if start_sample:
                self._warn_uneven_rest(epoch, start_sample)
        elif start_sample:
            return self._read_again(epoch, start_batch)
        else:  # e.g. a DistributedSampler, also inside a BatchSampler (batch_sampler= or sampler=)
            for sampler in samplers_of(self.loader):
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
        return self._fresh_iterator(epoch)

    def check_resumable_mid_epoch(self) -> None:
        """Refuse a mid-epoch resume whose epoch cannot be read again (before anything is restored)."""
        named = None if self.sampler is not None or self.replays() else own_generator(self.loader)
        if named is not None:
            raise DataError(f"cannot resume mid-epoch: the training DataLoader's {named} draws its order from a "
                            "torch.Generator of its own, whose state the checkpoint does not hold; resume from a "
                            "checkpoint taken at an epoch's end, or pass the Dataset (or a DataLoader with "
                            "shuffle=True) for mid-epoch resumes")

    def _read_again(self, epoch: int, start_batch: int) -> Any:
        """The epoch's iterator past the ``start_batch`` batches this process had taken (read, not
        trained on): the continuation is exact when the data gives the same batches when read again."""
        self.check_resumable_mid_epoch()
        for sampler in samplers_of(self.loader):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        batches = self._fresh_iterator(epoch)
        what = "an IterableDataset, which cannot seek" if self.replays() else \
            f"a DataLoader whose sampler ({type(self.loader.sampler).__name__}) cannot seek"
        log.warning("resuming mid-epoch in %s: reading the %d batch(es) this process had taken of epoch %d again "
                    "(loaded, not trained on: the cost of that many batches of data loading). The continuation is "
                    "exact when the data gives the same batches in the same order each time it is read",
                    what, start_batch, epoch)
        for taken in range(start_batch):
            if next(batches, None) is None:
                raise DataError(f"resuming mid-epoch: epoch {epoch} of the training data ended after {taken} "
                                f"batch(es), but the checkpoint was taken after {start_batch}: the data does not "
                                "give the same batches when read again")
        return batches

    def _warn_uneven_rest(self, epoch: int, start: int) -> None:
        """A mid-epoch resume on another number of processes: the rest of the epoch may not split
        evenly where the whole epoch did (or leave out more than it): its tail is left out, as a
        fresh start's is, so that every process takes the same samples and steps."""
        sampler = self.sampler
        assert sampler is not None
        n, world = sampler.n, sampler.world_size
        left_out = (n - start) % world if sampler.drop_last and world > 1 else 0
        if left_out and left_out != n % world:  # (as many as build_train_data warned about: the same run)
            log.warning("resuming epoch %d at sample %d of %d on %d processes: the %d sample(s) left of it do not "
                        "split evenly, so %d of them are left out of this epoch (every process takes the same "
                        "samples and steps). Later epochs are dealt from their start; resume on the checkpoint's "
                        "number of processes, or from an epoch's end, to train on every sample of this one",
                        epoch, start, n, world, n - start, left_out)

    def _fresh_iterator(self, epoch: int) -> Any:
        set_dataset_epoch(self.loader.dataset, epoch)  # a streaming dataset reshuffles through its own
        if self.generator is not None:
            self.generator.manual_seed(self.seed + epoch)  # DataLoader worker seeds
            if getattr(self.loader, "persistent_workers", False) and getattr(self.loader, "_iterator", None) is not None:
                # a reused persistent iterator does not draw the base seed a fresh one draws before
                # its sampler shuffles: drawn here, so that an epoch's order does not depend on
                # whether the iterator is reused (a resumed run's first epoch starts a fresh one)
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            if not self._draws_lazily():
                return start_workers(self.loader)
        # a DataLoader of the user's without generator= draws its workers' base seed from the
        # global CPU generator as its iterator starts: at the epoch's start in one run, at the
        # resume point in a resumed one. Drawn here from (seed, epoch), outside training's random
        # streams: the CPU generator alone is seeded (torch.manual_seed would reseed CUDA's too,
        # which fork_rng(devices=[]) does not restore: a GPU's dropout restarted every epoch)
        # A sampler of the user's read in this process draws its order as the first batch is
        # taken: taken here too, so that the order is the same when the epoch is read again
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self.seed + epoch)
            batches = start_workers(self.loader)
            if not self._draws_lazily():
                return batches
            first = next(batches, _END)
        return iter(()) if first is _END else itertools.chain([first], batches)

    def _draws_lazily(self) -> bool:
        """A map-style loader of the user's read in this process (``num_workers=0``), whose sampler
        is not lightlike's: it draws its order (from the global CPU generator, if random) as the
        first batch is taken, not as the iterator starts."""
        return self.sampler is None and not self.loader.num_workers and not isinstance(self.loader.dataset,
                                                                                        IterableDataset)


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
    module: Any = None,
    remove_unused_columns: bool = True,
) -> TrainData:
    """The training loader of ``data`` (a Dataset, a Hugging Face dataset or a DataLoader) and
    what the loop needs to know about it; ``module`` names its ``data_collator`` and the columns
    it reads (``lightlike/data/hf_datasets.py``)."""
    if data is None:
        raise DataError("fit() needs training data: fit(module, train_dataset, val_dataset)")
    if isinstance(data, DataLoader):
        if not isinstance(data.dataset, IterableDataset):
            check_nonempty(data.dataset, "training")
        if world_size > 1 and not already_split(data, world_size=world_size):
            data = _split_train_loader(data, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        elif not isinstance(data.sampler, ResumableSampler):
            data = seekable_loader(data, seed=seed, world_size=world_size)
        say_how_it_resumes(data, batch_size)
        sampler = data.sampler if isinstance(data.sampler, ResumableSampler) else None
        grouped = getattr(sampler, "batch_size", None)  # a LengthGroupedSampler's runs are its batches
        if grouped is not None and data.batch_size != grouped:
            raise DataError(f"the DataLoader's batch_size={data.batch_size} differs from its LengthGroupedSampler's "
                            f"batch_size={grouped}: its batches would not line up with the sampler's groups (and a "
                            "resume would repeat and skip items); build both with the same batch_size")
        n = sampler.n if sampler is not None else None
        return TrainData(data, sampler, n, seed, data.generator, world_size, from_user=True)
    if not isinstance(data, Dataset) and not hasattr(data, "__getitem__"):
        raise DataError(
            f"training data of type {type(data).__name__} is neither a torch Dataset nor a DataLoader"
        )
    inputs = loader_inputs(data, module, what="training", num_workers=num_workers, rank=rank, world_size=world_size,
                           remove_unused_columns=remove_unused_columns)
    data, num_workers, collate_fn = inputs.data, inputs.num_workers, collate_fn or inputs.collate_fn
    generator = torch.Generator()
    generator.manual_seed(seed)
    if isinstance(data, IterableDataset):
        if (world_size > 1 or num_workers > 1) and not inputs.shards_itself:
            data = ShardedIterable(data, rank, world_size)  # each item once over ranks and workers
        loader = DataLoader(data, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last,
                            pin_memory=pin_memory, collate_fn=collate_fn, generator=generator,
                            worker_init_fn=end_with_parent(None, num_workers))
        return TrainData(loader, None, None, seed, generator, world_size)
    n = check_nonempty(data, "training")
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
    # read through CheckedDataset/DefaultCollate: a bad item or __len__ is named (lightlike/data/checked.py)
    loader = DataLoader(CheckedDataset(data, "training"), batch_size=batch_size, sampler=sampler,
                        num_workers=num_workers, drop_last=drop_last, pin_memory=pin_memory,
                        collate_fn=collate_fn or DefaultCollate("training"), generator=generator,
                        worker_init_fn=end_with_parent(None, num_workers))
    return TrainData(loader, sampler, n, seed, generator, world_size)

# -- a DataLoader of the user's, on several processes ----------------------------------------------
# Like Lightning's use_distributed_sampler and Accelerate's prepare: the loader is rebuilt over
# the same dataset with the same settings and lightlike's split, so every rank takes its own
# share instead of the whole set.


def _split_train_loader(loader: DataLoader, *, shuffle: bool, seed: int, rank: int, world_size: int) -> DataLoader:
    batch_size, drop_last, custom = batching(loader)
    generator = torch.Generator()
    generator.manual_seed(seed)
    if isinstance(loader.dataset, IterableDataset):
        log.info("the training DataLoader's IterableDataset is sharded over %d processes (set shards_itself = True "
                 "on a dataset that shards itself)", world_size)
        return loader_like(loader, ShardedIterable(loader.dataset, rank, world_size), None, batch_size, drop_last,
                            generator)
    if loader.batch_sampler is None and yields_lists(loader.sampler):  # it yields index lists
        raise DataError(f"cannot split the training DataLoader over {world_size} processes: it reads ready-made "
                        f"batches (batch_size=None) through a sampler of index lists ({type(loader.sampler).__name__}"
                        ", such as a BatchSampler passed as sampler=), whose index lists "
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
    shuffled = None if custom else plain_shuffle(loader)
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
    return loader_like(loader, loader.dataset, sampler, batch_size, drop_last, generator)

"""Where the loop is in an epoch: global sample positions, counted once per optimizer step
(``TrainData.position`` makes one per epoch)."""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler

from lightlike.data.loader_info import batch_items, epoch_items
from lightlike.module import batch_length

if TYPE_CHECKING:
    from lightlike.data.loading import TrainData

log = logging.getLogger("lightlike")


class EpochPosition:
    """Where the loop is in an epoch, advanced once per optimizer step.

    Positions are global samples, counted from where the epoch's iterator began. With
    lightlike's sampler batches are dealt round-robin from the global order, so after k batches
    per rank the position is ``start + k * batch_size * world_size``, capped at the epoch's end
    (the last batch may be short). Counting from the iterator's own start keeps the position
    right when a resumed run uses another batch size or world size. A DataLoader of the user's
    is counted the same way, with the batch size its batch sampler gives and capped at the items
    its sampler gives in an epoch (a ``DistributedSampler``'s padding left out); an
    IterableDataset and a batch_sampler of the user's (whose batches may be of any length) are
    counted by the items of each batch taken (``batch_length``), summed over the ranks in the
    agreement the loop makes every step there anyway. Everything the step needs comes from one
    call."""

    __slots__ = ("_start", "_here", "_batches", "_global_batch", "_end", "_done_below", "_per_epoch",
                 "_batches_per_epoch", "_agreed_left", "_ahead", "_sum", "follows", "_promised", "_counts",
                 "_items", "_start_batches", "_world_size", "_reads_ahead", "_dealt", "_limit")

    def __init__(self, data: TrainData, start: int, batches_in_epoch: int, world_size: int):
        self._start, self._here, self._batches = start, 0, batches_in_epoch
        self._start_batches, self._world_size = batches_in_epoch, world_size
        loader = data.loader
        self._global_batch = batch_items(loader) * world_size
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
            self._done_below = self._global_batch if loader.drop_last else 1
            n = sampler.n
            self._per_epoch = n - n % sampler.world_size if sampler.drop_last else n
        else:
            self._end, self._done_below, self._per_epoch = epoch_items(loader, world_size), 0, 0
        self._ahead: Lookahead | None = None
        self._sum = data.sum_over_ranks
        # read one ahead (an IterableDataset, or no length): the ranks agree every step whether
        # the epoch ended, and the item counts ride along
        self._reads_ahead = agrees = self._promised is not None or not (
            self._per_epoch or self._batches_per_epoch is not None or self._agreed_left is not None)
        own_batches = sampler is None and loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler
        #: count the items of each batch taken (batches whose length the sampler does not tell)
        self._counts = (data.replays() or own_batches) and (world_size == 1 or (agrees and self._sum is not None))
        self._items = 0  # this rank's items taken since start (counted batches)
        #: ``limit_train_batches``: the epoch ends after this many batches per process (None: its data's end)
        self._limit = data.batch_limit
        #: lightlike's sampler, nothing counted, agreed, read ahead or limited: ``advance`` needs only the sampler's end
        self._dealt = bool(self._per_epoch) and not (self._counts or self._promised is not None
                                                      or self._agreed_left is not None or self._limit is not None)
        #: every rank has another batch (read ahead, agreed): the next window needs no agreement
        self.follows = False

    def watch(self, batches: Any) -> Any:
        """The epoch's batches, read one ahead where the epoch's length is unknown (an
        IterableDataset): ``advance`` then knows that a step took the epoch's last batch, and the
        epoch ends at that step's boundary, before its checkpoint, as a sized epoch does (else it
        ended at the next, empty, window: its evaluation came after the checkpoint, so a run
        resumed from it evaluated and logged that step again)."""
        left = self._agreed_left
        if self._reads_ahead:
            batches = self._ahead = Lookahead(batches)  # (it peeks past the cap below)
        cap = left if left is not None else self._promised  # (an IterableDataset's own __len__)
        if cap is not None:  # a longer share (or stream) stops at the cap, in every window too
            batches = itertools.islice(batches, max(0, cap - (self._batches if self._per_epoch == 0 else 0)))
        if self._counts:  # outermost: only the batches the loop takes
            batches = self._counted(batches)
        return batches

    def _counted(self, batches: Any) -> Any:
        fallback = self._global_batch // self._world_size
        for batch in batches:
            try:
                self._items += batch_length(batch)
            except TypeError:  # a batch whose length cannot be told: the batch size, or 1
                self._items += fallback
            yield batch

    def advance(self, batches: int) -> tuple[int, float, bool]:
        """After a step that took ``batches`` batches on each rank: (global samples consumed in
        the epoch, the fraction of the epoch done, whether the epoch ends: no batch left, or
        ``limit_train_batches`` reached, whose fraction is then that of the limited epoch; False
        where that is unknown, and an empty accumulation window then ends the epoch)."""
        self._here += batches
        self._batches += batches
        end = self._end
        if self._dealt:  # lightlike's sampler (the usual case): the general rules below, in short (no builtin min)
            samples = self._start + self._here * self._global_batch
            if samples > end:  # type: ignore[operator]
                samples = end
            fraction = samples / self._per_epoch  # type: ignore[operator]
            return samples, fraction if fraction < 1.0 else 1.0, end - samples < self._done_below  # type: ignore[operator,return-value]
        if self._counts:
            samples = self._start + self._items  # (one process; several sum theirs in ``_agreed``)
        else:
            samples = self._start + self._here * self._global_batch
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
            if self._sum is not None:
                done, samples, fraction = self._agreed(done)
            self.follows = not done
        elif left is not None:
            done = self._here >= left
        elif self._ahead is not None:
            ended = self._ahead.ended()
            done = ended
            if self._sum is not None:
                done, samples, fraction = self._agreed(ended)
            if done and not ended:
                log.warning("another rank ran out of training data: skipping the rest of this rank's share "
                            "of the epoch")
            self.follows = not done
        if self._limit is not None and not done:
            fraction, done = min(1.0, self._batches / self._limit), self._batches >= self._limit
        return samples, fraction, done

    def _agreed(self, flag: bool) -> tuple[bool, int, float]:
        """(whether ``flag`` is set on any rank, global samples, the epoch's fraction), the same on
        every rank, though each took its own batches this step (a rank's data may end sooner):
        one all-reduce, the one this step makes anyway to agree on the flag."""
        assert self._sum is not None
        flags, items, batches = (int(v) for v in self._sum([int(flag), self._items, self._here]))
        if self._counts:
            samples = self._start + items
        else:
            samples = self._start + batches * (self._global_batch // self._world_size)
            samples = samples if self._end is None else min(samples, self._end)
        per_epoch = self._batches_per_epoch
        taken = self._start_batches * self._world_size + batches  # (a resume's batches: this rank's, saved)
        fraction = min(1.0, taken / (per_epoch * self._world_size)) if per_epoch else 0.0
        return flags > 0, samples, fraction


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

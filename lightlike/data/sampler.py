"""A resumable sampler: the order is a function of (seed, epoch), the position is a number.

``ResumableSampler`` yields the indices of one epoch, starting from ``start`` samples into it.
The permutation is ``torch.randperm(n, generator=Generator().manual_seed(seed + epoch))``
(the same convention as torch's ``DistributedSampler``), so seeking is O(1): no consumed batch
is replayed. Positions are counted in *global* samples (all ranks together), so a position
saved on one world size maps onto another.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator an epoch's order is drawn from."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return g


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """The global order of epoch ``epoch``: a pure function of its arguments. ``generator``: the
    epoch's (``epoch_generator``), when the caller draws more from it after the permutation."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=generator if generator is not None else epoch_generator(seed, epoch))


class ResumableSampler(Sampler[int]):
    """Indices of one epoch for one rank, from a global sample position onward.

    With ``world_size`` W the global order is dealt round-robin: rank r takes global positions
    start + r, start + r + W, ... . ``even=True`` (training on several ranks) drops the global
    tail of fewer than W samples so that every rank gets the same number of samples, hence of
    batches and optimizer steps (no rank waits for a collective the others never join); those
    samples differ every epoch, since the order does. With ``even=False`` (evaluation) the last
    round is shorter on some ranks; nothing is ever padded with repeats.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        even: bool = False,
    ) -> None:
        self.n = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last or even
        self.epoch = 0
        self.start = 0  # global samples already consumed in this epoch

    def order_key(self) -> dict[str, int] | None:
        """What, besides (seed, epoch), the epoch's order depends on; kept in checkpoints so that a
        mid-epoch resume can refuse an order that would repeat and skip samples. None: nothing."""
        return None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch and the global sample position to continue from."""
        if not 0 <= start <= self.n:
            raise ValueError(f"start={start} is outside the epoch of {self.n} samples")
        self.epoch = int(epoch)
        self.start = int(start)

    @property
    def deals_evenly(self) -> bool:
        """Whether every rank gets as many samples as every other (``even``/``drop_last``, or one
        process): then the ranks take the same steps without agreeing on it."""
        return self.drop_last or self.world_size == 1

    def global_end(self) -> int:
        """Global samples per epoch that are dealt to ranks."""
        return self._global_end()

    def _global_end(self) -> int:
        if self.drop_last:  # the rest from ``start`` splits evenly (a resume may start anywhere)
            return self.n - (self.n - self.start) % self.world_size
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = epoch_permutation(self.n, self.seed, self.epoch, self.shuffle)
        mine = order[self.start + self.rank : self._global_end() : self.world_size]
        return iter(mine.tolist())

    def __len__(self) -> int:
        remaining = max(0, self._global_end() - self.start - self.rank)
        return (remaining + self.world_size - 1) // self.world_size


class EveryNth(Sampler):
    """The elements of ``sampler`` at positions ``rank``, ``rank + world_size``, ...: one rank's
    share of a sampler whose elements are whole batches, dealt as evaluation deals items."""

    def __init__(self, sampler: Any, rank: int, world_size: int):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.rank, None, self.world_size)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.sampler), self.world_size))

"""``LengthGroupedSampler``: batches of similar length (less padding), resumable like
``ResumableSampler``.

The epoch's global order is a pure function of (lengths, seed, epoch, group size): shuffle all
indices (``epoch_permutation``, the default sampler's convention), cut the shuffled order into
megabatches of ``group_size`` indices (by default ``mega * batch_size * world_size``, with
``mega`` at most 50 and at most a quarter of the data, as HF's sampler does), and sort each
megabatch by length, longest first. Consecutive runs of ``batch_size * world_size`` indices (one
global batch) then hold similar lengths, and each rank takes a contiguous run of ``batch_size``
of each global batch (rank r the r-th), so its batch is as homogeneous as the sorted order
allows (dealt round-robin, a rank's batch spanned the whole global batch: its longest item was
among the world_size longest, more padding than a random order when a megabatch is one global
batch). The last, partial, global batch is dealt round-robin, so every rank's share of the
epoch is as long as ``ResumableSampler``'s. The last megabatch
is sorted longest first down to a random rank and then shortest first up to it, so that the end of
the order (the tail that ``even=True`` leaves out) is of a random length rather than the same
shortest items every epoch. Seeking to a sample position is slicing that order: O(1) in consumed
batches, nothing is replayed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from lightlike.data.sampler import ResumableSampler, epoch_generator, epoch_permutation
from lightlike.errors import DataError


class LengthGroupedSampler(ResumableSampler):
    """Indices of one epoch for one rank, grouped into batches of similar length.

    ``lengths[i]`` is the length of item i (e.g. ``len(dataset[i]["input_ids"])``).
    ``batch_size`` must be the DataLoader's (per-rank) batch size, so that its batches line up
    with the groups. ``mega`` global batches form a megabatch, the unit that is sorted: larger
    means more homogeneous batches and less randomness. By default (``mega=None``) it is
    ``min(50, len(lengths) // (4 * batch_size * world_size))``, at least 1, as in HF's
    ``LengthGroupedSampler``: a small dataset is cut into at least 4 megabatches, so that the
    epochs differ by more than the order of equal lengths. ``group_size`` sets the megabatch in
    samples instead (default ``mega * batch_size * world_size``); a ``mega`` or ``group_size``
    you pass is kept as it is. The order depends on it: a run resumed mid-epoch with another batch
    size or world size must pass the first run's ``group_size`` (the resume says so, naming it).
    ``longest_first=True`` moves the longest item to the front of the epoch (as the HF Trainer
    does), so an out-of-memory error shows on the first step rather than hours in.

    The interface is ``ResumableSampler``'s (it is one): ``set_epoch(epoch, start)`` with
    ``start`` in global samples; ``rank``/``world_size`` sharding, by default this process's
    place in the job as torchrun or srun set it (iterating refuses to start when
    torch.distributed runs another number of processes); and ``even=True`` (default: this is a
    training sampler), dropping the global tail of fewer than ``world_size`` samples so every
    rank takes the same number of steps. With ``shuffle=True`` the last megabatch runs longest
    first down to a random rank r, then shortest first up to r (r drawn from seed and epoch), so
    that tail is of random length, not that megabatch's shortest items every epoch (with one
    sample left out, every item is as likely as any other to be the one, but the longest under
    ``longest_first``, which is always in the first batch); one batch spans the turn. A
    DataLoader built on it and passed to ``Fitter.fit`` resumes mid-epoch on the right sample.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        batch_size: int,
        *,
        mega: int | None = None,
        group_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        even: bool = True,
        longest_first: bool = True,
    ) -> None:
        lengths_t = torch.as_tensor(lengths)
        if lengths_t.ndim != 1 or lengths_t.is_floating_point() or lengths_t.is_complex():
            raise ValueError(f"lengths must be a 1-D sequence of ints (one per item), got shape "
                             f"{tuple(lengths_t.shape)} and dtype {lengths_t.dtype}")
        if len(lengths_t) == 0:
            raise ValueError("lengths is empty: LengthGroupedSampler needs at least one item")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if mega is not None and (not isinstance(mega, int) or mega < 1):
            raise ValueError(f"mega must be a positive int or None, got {mega!r}")
        if rank is None or world_size is None:
            from lightlike.strategies.environment import detect_environment

            env = detect_environment()  # torchrun's RANK/WORLD_SIZE, SLURM's, or a single process
            rank = env.rank if rank is None else rank
            world_size = env.world_size if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        super().__init__(len(lengths_t), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last, even=even)
        self.lengths = lengths_t.long()
        self.batch_size = batch_size
        if mega is None:  # HF's cap: at least 4 megabatches when the data allows, at most 50 batches each
            mega = max(1, min(50, len(lengths_t) // (4 * batch_size * world_size)))
        #: global batches per megabatch (the default is capped by the dataset size)
        self.mega = mega
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        #: indices sorted together; it shapes the epoch's order, so a run resumed mid-epoch must
        #: use the same (pass the old group_size when batch_size or world_size change)
        self.group_size = group_size or mega * batch_size * world_size
        self.longest_first = longest_first

    def order_key(self) -> dict[str, int]:
        return {"group_size": self.group_size}

    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """The order of all samples of ``epoch`` (all ranks together): a pure function."""
        epoch = self.epoch if epoch is None else epoch
        g = epoch_generator(self.seed, epoch) if self.shuffle else None  # it then draws the turn below
        order = epoch_permutation(self.n, self.seed, epoch, self.shuffle, g)
        groups = []
        for chunk in order.split(self.group_size):
            # stable: equal lengths keep their shuffled order
            keys = self.lengths[chunk]
            groups.append(chunk[torch.sort(keys, descending=True, stable=True).indices])
        if g is not None and len(groups[-1]) > 1:
            # even=True leaves out the end of the order (fewer than world_size samples), which a
            # sorted megabatch fills with its shortest items: the same ones every epoch when one
            # megabatch holds most of the data. Reversing the last megabatch from a random rank
            # on (longest ... rank r-1, then shortest ... rank r) ends the order on an item of
            # random rank instead, and keeps it two sorted runs (one batch spans the turn). It
            # stays a pure function of (seed, epoch, n, group_size), whatever the world size.
            last = groups[-1]
            turn = int(torch.randint(len(last), (1,), generator=g))
            if turn == 0 and self.longest_first and self._longest_of_all(last[0], groups):
                # the order would end on the longest item, which the swap below brings to the
                # front in exchange for the shortest (left out twice as often as the others)
                turn = 1 + int(torch.randint(len(last) - 1, (1,), generator=g))
            groups[-1] = torch.cat([last[:turn], last[turn:].flip(0)])
        out = torch.cat(groups)
        if self.longest_first:
            # swap the longest item with the first one (each heads a sorted megabatch, so both
            # batches stay close to homogeneous); ties resolve to the earliest position
            at = int(torch.argmax(self.lengths[out]))
            out[0], out[at] = out[at].clone(), out[0].clone()
        return out

    def _longest_of_all(self, item: torch.Tensor, groups: list[torch.Tensor]) -> bool:
        """Whether ``item`` (of the last megabatch) is longer than every item before it."""
        before = torch.cat(groups[:-1]) if len(groups) > 1 else None
        return before is None or bool(self.lengths[item] > self.lengths[before].max())

    def __iter__(self) -> Iterator[int]:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise DataError(f"LengthGroupedSampler(world_size={self.world_size}) but torch.distributed runs "
                            f"{dist.get_world_size()} processes: build it with rank=..., world_size=... of this "
                            "job (or leave both out to read them from torchrun/srun)")
        order, start, end = self.global_order(), self.start, self._global_end()
        span = self.batch_size * self.world_size  # one global batch, from where this epoch resumed
        whole = (end - start) // span
        runs = order[start : start + whole * span].view(whole, self.world_size, self.batch_size)[:, self.rank]
        tail = order[start + whole * span : end][self.rank :: self.world_size]
        return iter(torch.cat([runs.reshape(-1), tail]).tolist())

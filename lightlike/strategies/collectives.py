"""Collectives: what the ranks of a run compute together, apart from what a strategy does to
the module. ``strategy.collectives`` is one of two kinds:

- ``Collectives``: one process; every collective is the identity, nothing is waited for.
- ``DistributedCollectives``: ``torch.distributed`` over the default process group, which the
  strategy (DDP, FSDP, DeepSpeed) has started; the same calls, in the same order on every rank.

Every method is called at the same point on every rank (or on none): a collective that one rank
skips leaves the others waiting until the process group's timeout. The failure notes
(``note_failure``, ``failed_peers``) live here too: they say when this rank no longer takes part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Collectives:
    """One process: every collective gives back what it was given."""

    #: set by ``note_failure``: this rank is unwinding after an error of its own, so teardown
    #: must not wait for the other ranks (a peer may sit in another collective)
    failed: bool = False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over ranks with ``op`` (``"sum"``, ``"max"`` or ``"min"``), as a new
        tensor (the argument is left as it was)."""
        return tensor

    def sum_floats(self, values: list[float]) -> list[float]:
        """Sum host-side numbers over ranks (identity on one process)."""
        return values

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        return [obj]

    def gather_in_order(self, local: Any, dealt: bool = True) -> Any:
        """Evaluation outputs of every rank, in dataset order (identity on one process): dealt
        round-robin, as lightlike splits a set; ``dealt=False`` (a dataset that shards itself)
        rank 0's items first, then rank 1's, and so on."""
        return local

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank."""
        return obj

    def barrier(self, name: str = "") -> None:
        """Wait until every rank got here (``name`` says where, for the reader)."""

    def reduce_flag(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank (control decisions agree)."""
        return flag

    def reduce_flag_async(self, flag: bool) -> Callable[[], bool]:
        """Start agreeing on ``flag`` as ``reduce_flag`` does; the returned function, called later
        at the same point on every rank, gives the agreed value. For checks that can wait a few
        steps (preemption), so that agreeing costs the step no wait and no device sync."""
        value = self.reduce_flag(flag)
        return lambda: value

    def note_failure(self, report: str | None = None, call: int = 0) -> None:
        """The loop is unwinding after an error of this rank's: teardown must not wait for the
        other ranks. ``report`` (this rank's one-line account of call number ``call``) is left
        where the peers can read it (``failed_peers``)."""
        self.failed = True

    def failed_peers(self, call: int = 0) -> list[str]:
        """The reports other ranks left with ``note_failure`` for call number ``call``, in rank
        order (none that cannot be read)."""
        return []


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class DistributedCollectives(Collectives):
    """``torch.distributed`` over the default process group. ``ranks`` is the strategy, asked for
    ``world_size``, ``global_rank`` and ``root_device`` at each call (they are known only once its
    ``setup_environment`` has run; tensors go to the device the backend reduces on)."""

    def __init__(self, ranks: Any) -> None:
        self._ranks = ranks

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=_OPS[op])
        return out

    def sum_floats(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._ranks.root_device)
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._ranks.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_in_order(self, local: Any, dealt: bool = True) -> Any:
        """Reassemble per-rank evaluation outputs in dataset order: rank r holds the items at
        global positions r, r + W, r + 2W, ... (the evaluation sampler deals them round-robin);
        ``dealt=False``: one rank's after another's."""
        return _reassemble(self.all_gather_object(local), dealt)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self, name: str = "") -> None:
        dist.barrier()

    def reduce_flag(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], device=self._ranks.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def reduce_flag_async(self, flag: bool) -> Callable[[], bool]:
        """An all-reduce started now and read when asked. On CUDA the value is copied to pinned
        host memory behind the collective and read through an event, so the caller waits only
        for work queued before it (long done some steps later), never for the current step's."""
        t = torch.tensor([1 if flag else 0], device=self._ranks.root_device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        assert work is not None
        if t.device.type != "cuda":
            def wait_and_read() -> bool:
                work.wait()
                return bool(t.item())
            return wait_and_read
        work.wait()  # NCCL: the current stream waits for the collective; the host goes on
        host = torch.empty_like(t, device="cpu").pin_memory()
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def read() -> bool:
            ready.synchronize()
            return bool(host.item())
        return read

    def note_failure(self, report: str | None = None, call: int = 0) -> None:
        self.failed = True
        if report is not None and self._ranks.world_size > 1 and dist.is_initialized():
            # the process group's store outlives this process under torchrun (its agent keeps
            # it); a store that cannot be reached only costs the peers the name
            with contextlib.suppress(Exception):
                _store().set(f"lightlike/failed/{call}/{self._ranks.global_rank}", report[:4000])

    def failed_peers(self, call: int = 0) -> list[str]:
        world, rank = self._ranks.world_size, self._ranks.global_rank
        if world == 1 or not dist.is_initialized():
            return []
        try:
            store = _store()
            keys = [f"lightlike/failed/{call}/{r}" for r in range(world) if r != rank]
            return [store.get(k).decode() for k in keys if store.check([k])]
        except Exception:  # the store went with the failed process (it was rank 0's)
            return []


def _store() -> Any:
    """The default process group's key-value store (torch keeps no public accessor)."""
    return dist.distributed_c10d._get_default_store()


def _reassemble(parts: list[Any], dealt: bool = True) -> Any:
    """The ranks' evaluation outputs as one: per item, interleaved (``dealt``: rank r held the
    items at positions r, r + W, ...) or one rank's after another's; dicts and tuples field by
    field (a list holds one value per item)."""
    if all(p is None for p in parts):
        return None
    first = next(p for p in parts if p is not None)
    if isinstance(first, dict):
        return {k: _reassemble([p[k] for p in parts], dealt) for k in first}
    if isinstance(first, tuple):
        fields = [_reassemble([p[j] for p in parts], dealt) for j in range(len(first))]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
    if not dealt:
        return torch.cat(parts) if isinstance(first, torch.Tensor) else [x for p in parts for x in p]
    total = sum(len(p) for p in parts)
    merged: Any = first.new_empty((total, *first.shape[1:])) if isinstance(first, torch.Tensor) else [None] * total
    for r, p in enumerate(parts):
        merged[r::len(parts)] = p if isinstance(first, torch.Tensor) else list(p)
    return merged

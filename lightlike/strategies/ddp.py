"""Data parallel over processes: ``torch.nn.parallel.DistributedDataParallel``.

One process per device, launched by ``torchrun`` or ``srun``. Gradients are all-reduced (averaged)
by DDP on the last micro-batch of each window only (``no_sync`` on the others). Exact
accumulation across ranks: the step's item count is all-reduced once per step, and micro-batch i
is weighted by ``n_i * world_size / N_global``, which DDP's averaging turns into the gradient of
the mean loss over every item on every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.precision.base import NO_CONTEXT
from lightlike.strategies.base import StepNormaliser, Strategy
from lightlike.strategies.environment import ClusterEnvironment, detect_environment

log = logging.getLogger("lightlike")


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(
        self,
        accelerator: str = "auto",
        precision: Precision | None = None,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 600.0,
        backend: str | None = None,
    ) -> None:
        super().__init__(accelerator, precision)
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                               gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb)
        self.timeout_s = timeout_s
        self.backend = backend
        self.env: ClusterEnvironment | None = None
        self._owns_group = False
        self._failed = False
        self._synced: weakref.WeakSet = weakref.WeakSet()  # static_graph wrappers past a synchronised backward

    # -- processes and devices -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.env.world_size if self.env else 1

    @property
    def global_rank(self) -> int:
        return self.env.rank if self.env else 0

    @property
    def local_rank(self) -> int:
        return self.env.local_rank if self.env else 0

    def setup_environment(self) -> None:
        self.env = env = detect_environment()
        if env.kind != "single":
            env.export()
        if self.accelerator in ("auto", "cuda") and torch.cuda.is_available():
            if env.local_rank >= torch.cuda.device_count():
                raise ConfigError(f"local rank {env.local_rank} has no CUDA device: {torch.cuda.device_count()} "
                                  "visible; launch at most that many processes per node")
            self.root_device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(self.root_device)
        elif self.accelerator in ("auto", "cpu"):
            self.root_device = torch.device("cpu")
        elif self.accelerator == "cuda":
            raise ConfigError("accelerator='cuda' but CUDA is not available here (torch.cuda.is_available() is "
                              "False): use accelerator='cpu' or 'auto' (gloo on the CPU), or run on a machine with "
                              "a GPU and a CUDA build of torch")
        elif str(self.accelerator).startswith("cuda:"):
            raise ConfigError(f"accelerator={self.accelerator!r} names one device, but under strategy='ddp' each "
                              "process takes cuda:LOCAL_RANK: use accelerator='cuda' (or 'auto'), and "
                              "CUDA_VISIBLE_DEVICES to choose the GPUs")
        else:
            raise ConfigError(f"accelerator={self.accelerator!r} is not supported by strategy='ddp'; use 'auto', "
                              "'cpu' or 'cuda'")
        backend = self.backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            kwargs: dict[str, Any] = {}
            if backend == "nccl":
                kwargs["device_id"] = self.root_device
            if env.kind == "single":  # one plain process (no launcher): an in-memory store, no port
                kwargs["store"] = dist.HashStore()
            elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun's agent keeps one store across --max-restarts: a restarted attempt read
                # the dead attempt's keys (gloo dialled its peers' old addresses and failed or hung)
                agent = dist.TCPStore(env.main_address, env.main_port, env.world_size, is_master=False,
                                      timeout=datetime.timedelta(seconds=self.timeout_s))
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                kwargs["store"] = dist.PrefixStore(f"/lightlike/attempt_{attempt}", agent)
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(seconds=self.timeout_s), **kwargs)
            self._owns_group = True
            atexit.register(self.teardown)
        elif dist.get_world_size() != env.world_size:
            raise ConfigError(f"a process group of {dist.get_world_size()} already exists but the environment says "
                              f"WORLD_SIZE={env.world_size}")
        self.precision.setup(self.root_device)
        log.debug("rank %d/%d on %s (%s, %s)", env.rank, env.world_size, self.root_device, env.kind, backend)

    def teardown(self) -> None:
        """Destroy the process group once every rank got here: a rank tearing gloo down while a
        peer still talks to it can abort the peer at exit ("terminate called ...")."""
        if self._owns_group and dist.is_initialized():
            # free unreachable DDP wrappers (reference cycles) while their process group still
            # exists: a Reducer destroyed after the group aborts the process at exit
            gc.collect()
            if not self._failed:  # after a failure, a peer may sit in another collective: no barrier
                try:
                    dist.barrier()
                except Exception as error:  # a peer is gone already: nothing to wait for, but say so
                    log.warning("rank %d of %d: a peer process failed or exited after the last lightlike call "
                                "(outside fit/validate/test/predict; its own output says why): %s: %s",
                                self.global_rank, self.world_size, type(error).__name__, error)
            dist.destroy_process_group()
            self._owns_group = False

    def note_failure(self, report: str | None = None, call: int = 0) -> None:
        self._failed = True
        if report is not None and self.world_size > 1 and dist.is_initialized():
            # the process group's store outlives this process under torchrun (its agent keeps
            # it); a store that cannot be reached only costs the peers the name
            with contextlib.suppress(Exception):
                _store().set(f"lightlike/failed/{call}/{self.global_rank}", report[:4000])

    def failed_peers(self, call: int = 0) -> list[str]:
        if self.world_size == 1 or not dist.is_initialized():
            return []
        try:
            store = _store()
            keys = [f"lightlike/failed/{call}/{r}" for r in range(self.world_size) if r != self.global_rank]
            return [store.get(k).decode() for k in keys if store.check([k])]
        except Exception:  # the store went with the failed process (it was rank 0's)
            return []

    # -- module and optimizer ------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none exist unless imported
        sharded = next((n for n, p in module.named_parameters() if dtensor and isinstance(p, dtensor)), None)
        if sharded is not None:  # DDP's first broadcast failed on it with a bare DTensor error
            raise ConfigError(
                f"the module's parameters are sharded (DTensor: {sharded!r}; an FSDP fit, or tensor parallelism, "
                "leaves them so): DDP cannot take it; use strategy='fsdp' for this Fitter too, or load the "
                "checkpoint's weights into a fresh module (module.load_weights('output_dir/checkpoint-N'))")
        module = super().setup_module(module)
        ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, **self.ddp_kwargs)  # type: ignore[arg-type]

    def unwrap(self, module: nn.Module) -> nn.Module:
        inner = getattr(module, "_orig_mod", module)  # torch.compile
        return inner.module if isinstance(inner, DistributedDataParallel) else inner

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[nn.Module]:
        # Every rank takes rank 0's buffers here, where every rank is. DDP's own forward would
        # broadcast them at the first forward after a training one, a collective that a rank
        # without evaluation batches never joins (it hung); FSDP and DeepSpeed never sync them,
        # so each rank evaluated with its own BatchNorm statistics.
        self.broadcast_buffers(model)
        inner = getattr(model, "_orig_mod", model)
        if isinstance(inner, DistributedDataParallel):
            inner.require_forward_param_sync = False  # synced just above: its forward must not again
        yield model

    def broadcast_buffers(self, model: nn.Module) -> None:
        """Every rank takes rank 0's buffers (collective)."""
        if self.world_size > 1:
            for buffer in self.unwrap(model).buffers():
                dist.broadcast(buffer, src=0)

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        # (the usual module is the DDP wrapper itself: asked first, since getattr of a missing
        # attribute goes through nn.Module.__getattr__, which builds and raises an AttributeError)
        inner = module if type(module) is DistributedDataParallel else getattr(module, "_orig_mod", module)
        if not isinstance(inner, DistributedDataParallel):
            return NO_CONTEXT
        if self.ddp_kwargs["static_graph"] and inner not in self._synced:
            # static_graph's reducer must see a synchronised backward before any under no_sync
            # (torch's "expect_autograd_hooks_" assert): the first window all-reduces every
            # micro-step, which sums to the same gradient
            if not enabled:
                self._synced.add(inner)
            return NO_CONTEXT
        return inner.no_sync() if enabled else NO_CONTEXT

    # -- exact accumulation ----------------------------------------------------------------------
    def item_normaliser(self, counts: list[int | torch.Tensor], flag: bool = False,
                        uniform: bool = False) -> StepNormaliser:
        """``N_global / world_size`` and the OR of ``flag`` over ranks, in one all-reduce per step,
        started here and awaited at first use (after the first micro-batch's forward pass). DDP
        averages gradients over ranks, so ``n_i / (N_global / W)`` gives the global item mean.
        The flag stays a device tensor: the Fitter reads it every step on CPU, and on an
        accelerator only at log steps, where it synchronises anyway."""
        local = sum(counts[1:], counts[0])  # this rank's count (as the base's total)
        if uniform and not isinstance(local, torch.Tensor):
            # every rank holds the same count: N_global / W is the local count, no collective
            return StepNormaliser(local, None)
        packed = torch.stack([torch.as_tensor(local, dtype=torch.float64, device=self.root_device),
                              torch.tensor(1.0 if flag else 0.0, dtype=torch.float64, device=self.root_device)])
        return _ReducingNormaliser(packed, dist.all_reduce(packed, async_op=True), self.world_size)

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        out = tensor.clone()
        dist.all_reduce(out, op=ops[op])
        return out

    def sum_floats(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.root_device)
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self, name: str = "") -> None:
        dist.barrier()

    def reduce_flag(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], device=self.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def reduce_flag_async(self, flag: bool) -> Callable[[], bool]:
        """An all-reduce started now and read when asked. On CUDA the value is copied to pinned
        host memory behind the collective and read through an event, so the caller waits only
        for work queued before it (long done some steps later), never for the current step's."""
        t = torch.tensor([1 if flag else 0], device=self.root_device)
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

    def gather_in_order(self, local: Any, dealt: bool = True) -> Any:
        """Reassemble per-rank evaluation outputs in dataset order: rank r holds the items at
        global positions r, r + W, r + 2W, ... (the evaluation sampler deals them round-robin);
        ``dealt=False``: one rank's after another's."""
        parts = self.all_gather_object(local)
        return _reassemble(parts, dealt)

    def __repr__(self) -> str:
        return (f"DDPStrategy(rank={self.global_rank}/{self.world_size}, device={self.root_device}, "
                f"precision={self.precision.name!r})")


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


class _ReducingNormaliser(StepNormaliser):
    """``DDPStrategy.item_normaliser``'s result while its all-reduce runs: the first read of
    ``total`` or ``flag`` waits for it, so the reduction overlaps the first forward pass."""

    __slots__ = ("_packed", "_work", "_world_size", "_result")

    def __init__(self, packed: torch.Tensor, work: Any, world_size: int):
        self._packed, self._work, self._world_size = packed, work, world_size
        self._result: tuple[torch.Tensor, torch.Tensor] | None = None

    def _finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._result is None:
            self._work.wait()
            self._result = (self._packed[0] / self._world_size, self._packed[1] > 0)
        return self._result

    @property
    def total(self) -> torch.Tensor:  # type: ignore[override]
        return self._finish()[0]

    @property
    def flag(self) -> torch.Tensor:
        return self._finish()[1]

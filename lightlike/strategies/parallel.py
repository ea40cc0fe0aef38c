"""The base of the strategies that run one process per device: DDP, FSDP and DeepSpeed.

What they share and nothing else: the process group started from the ``ClusterEnvironment``
(torchrun, srun, or one plain process) and torn down once every rank got there, the device
bound to the local rank, ranks read from the environment, ``torch.distributed`` collectives
(``strategy.collectives``), rank 0's buffers given to every rank, and the item normaliser of
exact accumulation reduced over ranks. Each of DDP, FSDP and DeepSpeed derives from this and
implements the rest of the ``Strategy`` contract its own way.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.strategies.base import CPU, StepNormaliser, Strategy
from lightlike.strategies.collectives import DistributedCollectives
from lightlike.strategies.environment import ClusterEnvironment, detect_environment

log = logging.getLogger("lightlike")


class ParallelStrategy(Strategy):
    """One process per device over a ``torch.distributed`` process group.

    ``timeout_s``: how long a collective waits for the other ranks; ``backend``: the process
    group's (default ``nccl`` on CUDA, ``gloo`` on the CPU)."""

    name = "parallel"

    def __init__(self, accelerator: str = "auto", precision: Precision | None = None, *,
                 timeout_s: float = 600.0, backend: str | None = None) -> None:
        super().__init__(accelerator, precision)
        self.timeout_s = timeout_s
        self.backend = backend
        self.env: ClusterEnvironment | None = None
        self._owns_group = False
        self.collectives: DistributedCollectives = DistributedCollectives(self)

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
        """Bind this process's device (``cuda:LOCAL_RANK``, or the CPU), start the process group
        unless one of the environment's size exists, and set up the precision plugin."""
        self.env = env = detect_environment()
        if env.kind != "single":
            env.export()
        self._bind_device(env)
        backend = self.backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            self._start_group(env, backend)
        elif dist.get_world_size() != env.world_size:
            raise ConfigError(f"a process group of {dist.get_world_size()} already exists but the environment says "
                              f"WORLD_SIZE={env.world_size}")
        self.precision.setup(self.root_device)
        log.debug("rank %d/%d on %s (%s, %s)", env.rank, env.world_size, self.root_device, env.kind, backend)

    def _bind_device(self, env: ClusterEnvironment) -> None:
        if self._accelerator in ("auto", "cuda") and torch.cuda.is_available():
            if env.local_rank >= torch.cuda.device_count():
                raise ConfigError(f"local rank {env.local_rank} has no CUDA device: {torch.cuda.device_count()} "
                                  "visible; launch at most that many processes per node")
            self.root_device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(self.root_device)
        elif self._accelerator in ("auto", "cpu"):
            self.root_device = CPU
        elif self._accelerator == "cuda":
            raise ConfigError("accelerator='cuda' but CUDA is not available here (torch.cuda.is_available() is "
                              "False): use accelerator='cpu' or 'auto' (gloo on the CPU), or run on a machine with "
                              "a GPU and a CUDA build of torch")
        elif str(self._accelerator).startswith("cuda:"):
            raise ConfigError(f"accelerator={self._accelerator!r} names one device, but under strategy='ddp' each "
                              "process takes cuda:LOCAL_RANK: use accelerator='cuda' (or 'auto'), and "
                              "CUDA_VISIBLE_DEVICES to choose the GPUs")
        else:
            raise ConfigError(f"accelerator={self._accelerator!r} is not supported by strategy='ddp'; use 'auto', "
                              "'cpu' or 'cuda'")

    def _start_group(self, env: ClusterEnvironment, backend: str) -> None:
        """``init_process_group`` for this environment; torn down by ``teardown`` (at exit too)."""
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

    def teardown(self) -> None:
        """Destroy the process group once every rank got here: a rank tearing gloo down while a
        peer still talks to it can abort the peer at exit ("terminate called ...")."""
        if self._owns_group and dist.is_initialized():
            # free unreachable DDP wrappers (reference cycles) while their process group still
            # exists: a Reducer destroyed after the group aborts the process at exit
            gc.collect()
            if not self.collectives.failed:  # after a failure, a peer may sit in another collective: no barrier
                try:
                    dist.barrier()
                except Exception as error:  # a peer is gone already: nothing to wait for, but say so
                    log.warning("rank %d of %d: a peer process failed or exited after the last lightlike call "
                                "(outside fit/validate/test/predict; its own output says why): %s: %s",
                                self.global_rank, self.world_size, type(error).__name__, error)
            dist.destroy_process_group()
            self._owns_group = False

    # -- buffers ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[nn.Module]:
        # Every rank takes rank 0's buffers here, where every rank is. DDP's own forward would
        # broadcast them at the first forward after a training one, a collective that a rank
        # without evaluation batches never joins (it hung); FSDP and DeepSpeed never sync them,
        # so each rank evaluated with its own BatchNorm statistics.
        self.broadcast_buffers(model)
        yield model

    def broadcast_buffers(self, model: nn.Module) -> None:
        """Every rank takes rank 0's buffers (collective)."""
        if self.world_size > 1:
            for buffer in self.unwrap(model).buffers():
                dist.broadcast(buffer, src=0)

    # -- exact accumulation ----------------------------------------------------------------------
    def item_normaliser(self, counts: list[int | torch.Tensor], uniform: bool = False) -> StepNormaliser:
        """``N_global / world_size``, in one all-reduce per step, started here and awaited at first
        use (after the first micro-batch's forward pass). DDP, FSDP and DeepSpeed average gradients
        over ranks, so ``n_i / (N_global / W)`` gives the global item mean."""
        local = sum(counts[1:], counts[0])  # this rank's count (as the base's total)
        if uniform and not isinstance(local, torch.Tensor):
            # every rank holds the same count: N_global / W is the local count, no collective
            return StepNormaliser(local)
        # a new tensor (never the caller's count), reduced in place
        count = torch.tensor(local, dtype=torch.float64, device=self.root_device) if not isinstance(local, torch.Tensor) \
            else local.to(self.root_device, torch.float64, copy=True)
        return _ReducingNormaliser(count, dist.all_reduce(count, async_op=True), self.world_size)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.global_rank}/{self.world_size}, device={self.root_device}, "
                f"precision={self.precision.name!r})")


class _ReducingNormaliser(StepNormaliser):
    """``ParallelStrategy.item_normaliser``'s result while its all-reduce runs: the first read of
    ``total`` waits for it, so the reduction overlaps the first forward pass."""

    __slots__ = ("_count", "_work", "_world_size", "_total")

    def __init__(self, count: torch.Tensor, work: Any, world_size: int):
        self._count, self._work, self._world_size = count, work, world_size
        self._total: torch.Tensor | None = None

    @property
    def total(self) -> torch.Tensor:  # type: ignore[override]
        if self._total is None:
            self._work.wait()
            self._total = self._count / self._world_size
        return self._total

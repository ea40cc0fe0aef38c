"""Data parallel over processes: ``torch.nn.parallel.DistributedDataParallel``.

One process per device, launched by ``torchrun`` or ``srun``. Gradients are all-reduced (averaged)
by DDP on the last micro-batch of each window only (``no_sync`` on the others). Exact
accumulation across ranks: the step's item count is all-reduced once per step, and micro-batch i
is weighted by ``n_i * world_size / N_global``, which DDP's averaging turns into the gradient of
the mean loss over every item on every rank.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.strategies.agreement import StepAgreement
from lightlike.strategies.parallel import ParallelStrategy


class DDPStrategy(ParallelStrategy):
    """Every rank holds the whole module, wrapped in ``DistributedDataParallel``, which averages
    the gradients over ranks in the last backward of each accumulation window. The keywords
    ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view`` and
    ``bucket_cap_mb`` are DDP's own; ``timeout_s`` and ``backend`` the process group's.
    ``gradient_as_bucket_view`` is True by default (torch's is False): the gradients are views
    into DDP's communication buckets instead of a second copy of them (4 bytes per parameter
    less in fp32), and the weights trained are the same, bit for bit."""

    name = "ddp"
    _plain_gradients = True

    def __init__(
        self,
        accelerator: str = "auto",
        precision: Precision | None = None,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 600.0,
        backend: str | None = None,
    ) -> None:
        super().__init__(accelerator, precision, timeout_s=timeout_s, backend=backend)
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                               gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb)
        self._synced: weakref.WeakSet = weakref.WeakSet()  # static_graph wrappers past a synchronised backward
        self._averages_at_step = False  # manual optimization: no reducer, gradients averaged at each step
        #: manual optimization on several ranks: the ranks agree on each ctx.step and on the end of
        #: each training step (``agreement.py``; the step context calls its ``end_step``); else None
        self.step_agreement: StepAgreement | None = None
        self._agreement_group: Any = None  # the gloo group it agrees over, where the default one is not gloo

    # -- module and optimizer ------------------------------------------------------------------
    def setup_module(self, module: nn.Module, manual: bool = False) -> nn.Module:
        if manual:
            return self._setup_manual(module)
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # none exist unless imported
        sharded = next((n for n, p in module.named_parameters() if dtensor and isinstance(p, dtensor)), None)
        if sharded is not None:  # DDP's first broadcast failed on it with a bare DTensor error
            raise ConfigError(
                f"the module's parameters are sharded (DTensor: {sharded!r}; an FSDP fit, or tensor parallelism, "
                "leaves them so): DDP cannot take it; use strategy='fsdp' for this Fitter too, or load the "
                "checkpoint's weights into a fresh module (module.load_weights('output_dir/checkpoint-N'))")
        module = self.precision.convert_module(module).to(self.root_device)
        self._averages_at_step, self.step_agreement = False, None  # DDP's reducer averages in backward
        ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, **self.ddp_kwargs)  # type: ignore[arg-type]

    def _setup_manual(self, module: nn.Module) -> nn.Module:
        """Manual optimization: the module is not wrapped in DDP, whose reducer expects one
        backward over every parameter per step (two backward passes over parts of the module
        fail or hang there). Parameters and buffers start as rank 0's; each optimizer's gradients
        are averaged over the ranks at ``ctx.step`` (``prepare_gradients``).
        Buffers (BatchNorm statistics) are not broadcast at each forward as DDP does: evaluation
        and checkpoints take rank 0's."""
        module = self.precision.convert_module(module).to(self.root_device)
        for tensor in [*module.parameters(), *module.buffers()]:
            torch.distributed.broadcast(tensor.data, src=0)
        self._averages_at_step = True
        if self.world_size > 1:  # the ranks agree on each ctx.step over a CPU group: no device sync
            if self._agreement_group is None and torch.distributed.get_backend() != "gloo":
                self._agreement_group = torch.distributed.new_group(backend="gloo")
            self.step_agreement = StepAgreement(self.global_rank, self.world_size, self._agreement_group)
        return module

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, where: tuple[int, int] = (0, 0)) -> None:
        """Unscaled; under manual optimization also averaged over the ranks first (one
        all-reduce per dtype and device over the flattened gradients, divided by the world size),
        once the ranks agree that each is at this ``ctx.step`` (``agreement.py``: a rank without a
        gradient another rank has contributes zeros)."""
        if self._averages_at_step and self.step_agreement is not None:
            params = self.step_agreement.params_with_gradients(optimizer, *where)
            if not params:
                return  # no rank has a gradient: nothing to average or unscale
            self._average(params)
        self.precision.unscale_gradients(optimizer)

    def _average(self, params: list[torch.Tensor]) -> None:
        if not params:
            return
        groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)  # type: ignore[union-attr]
        for grads in groups.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat)
            flat /= self.world_size
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

    def unwrap(self, module: nn.Module) -> nn.Module:
        inner = getattr(module, "_orig_mod", module)  # torch.compile
        return inner.module if isinstance(inner, DistributedDataParallel) else inner

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[nn.Module]:
        with super().evaluating(model) as m:  # every rank takes rank 0's buffers, where every rank is
            inner = getattr(m, "_orig_mod", m)
            if isinstance(inner, DistributedDataParallel):
                inner.require_forward_param_sync = False  # synced already: its forward must not again
            yield m

    # -- a training step -----------------------------------------------------------------------
    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        inner = getattr(module, "_orig_mod", module)  # torch.compile
        if not isinstance(inner, DistributedDataParallel):
            return contextlib.nullcontext()
        if self.ddp_kwargs["static_graph"] and inner not in self._synced:
            # static_graph's reducer must see a synchronised backward before any under no_sync
            # (torch's "expect_autograd_hooks_" assert): the first window all-reduces every
            # micro-step, which sums to the same gradient
            if not enabled:
                self._synced.add(inner)
            return contextlib.nullcontext()
        return inner.no_sync() if enabled else contextlib.nullcontext()

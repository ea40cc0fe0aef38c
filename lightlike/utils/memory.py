"""Memory: the peak of this process on its device, and what a rank holds for its training state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes on a CUDA device; peak resident set size of the process otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None


def memory_footprint(strategy: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters (``params``), gradients (``grads``) and optimizer state (``optimizer``)
    that *this rank* holds: its local shards under sharded strategies, for memory comparisons
    between strategies (benchmarks, tests). ``module`` is the one the loop calls.

    A strategy that keeps its partitions where the module does not show them (DeepSpeed's ZeRO
    optimizer) counts them itself, through a method of its own named ``partition_footprint``
    (same arguments; None where the plain count holds)."""
    own = getattr(strategy, "partition_footprint", None)
    counted = own(module, optimizer) if callable(own) else None
    if counted is not None:
        return counted  # type: ignore[no-any-return]
    params = list(strategy.unwrap(module).parameters())
    opt_tensors = [] if optimizer is None else [
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"params": _nbytes(params), "grads": _nbytes([p.grad for p in params if p.grad is not None]),
            "optimizer": _nbytes(opt_tensors)}


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held locally: a DTensor (FSDP2 shard) counts its local shard only."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total

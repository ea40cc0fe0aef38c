"""Training losses between log steps: kept on the device as the steps run (no host read per
step), read to the host and summed item-weighted at log steps, in one sync for all of them."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from lightlike.errors import NonFiniteLossError

#: a pending loss: (the detached loss tensor, its item count, the step, the micro-batch)
Pending = tuple[torch.Tensor, Any, int, int]


def item_weight(count: int | torch.Tensor, total: int | torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    """count / total: a Python float for int counts, else a device tensor (computed in float64)."""
    if isinstance(count, torch.Tensor) or isinstance(total, torch.Tensor):  # no host read: stays a tensor
        return (torch.as_tensor(count, dtype=torch.float64) / torch.as_tensor(total, dtype=torch.float64)).to(dtype)
    return count / total if total else 0.0  # no item in the whole step: its loss is 0/0 anyway


def read_pending(pending: list[Pending], device: torch.device, raise_nonfinite: bool) -> list[tuple[float, float, int, int]]:
    """The pending losses and item counts on the host, as (loss, items, step, micro-batch).
    With ``raise_nonfinite``, raises ``NonFiniteLossError`` naming the first bad step and
    micro-batch."""
    if not pending:
        return []
    # one stack, then one cast (stack promotes mixed dtypes exactly; a cast per loss costs ~2 us
    # each, 100 of them per log step by default); columns and rows made in C (zip, map)
    loss_tensors, counts, steps, micros = zip(*pending, strict=True)
    losses = torch.stack(loss_tensors).double().tolist()
    if any(issubclass(kind, torch.Tensor) for kind in set(map(type, counts))):  # token counts on the device
        items = torch.stack([torch.as_tensor(n, device=device) for n in counts]).double().tolist()
    else:
        items = list(map(float, counts))
    values = list(zip(losses, items, steps, micros, strict=True))
    if raise_nonfinite and not all(map(math.isfinite, losses)):
        for loss, n, step, micro in values:
            if not math.isfinite(loss):
                raise NonFiniteLossError(step, micro, loss, items=n)
    return values


def sum_pending(strategy: Any, values: list[tuple[float, float, int, int]]) -> tuple[float, float]:
    """Item-weighted loss sum and item count of read pending values, over every rank."""
    losses, items = list(zip(*values, strict=True))[:2] if values else ((), ())
    loss_sum, item_sum = sum(map(operator.mul, losses, items)), sum(items)
    return tuple(strategy.collectives.sum_floats([loss_sum, item_sum]))  # type: ignore[return-value]

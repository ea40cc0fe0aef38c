"""Training losses between log steps (``LossBuffer``): kept on the device as the steps run (no
host read per step), read to the host and summed item-weighted at log steps, in one sync for all
of them. The buffer is checkpointed, so the first row after a resume averages what the
uninterrupted run's would.

Under ``nonfinite_loss="raise"`` it also holds each step's global gradient norm (a device
tensor), read with the losses: a finite loss can have a NaN/inf gradient, and the read that
happens before every save, at log steps and at the end of the fit raises for whichever came
first, so no checkpoint is written after the last finite step."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from lightlike.errors import NonFiniteGradientError, NonFiniteLossError

#: a pending loss: (the detached loss tensor, its item count, the step, the micro-batch)
Pending = tuple[torch.Tensor, Any, int, int]


def weighted(loss: torch.Tensor, count: int | torch.Tensor, total: int | torch.Tensor) -> torch.Tensor:
    """``loss * count / total``: the micro-batch's share of the step's mean loss. The weight is a
    Python float for int counts, else a device tensor (computed in float64, no host read). A
    micro-batch that is the whole step (``count == total``, ints) is its loss as it is: no
    multiply by 1 in the forward or in the backward."""
    if isinstance(count, torch.Tensor) or isinstance(total, torch.Tensor):  # no host read: stays a tensor
        weight = torch.as_tensor(count, dtype=torch.float64) / torch.as_tensor(total, dtype=torch.float64)
        return loss * weight.to(loss.dtype)
    if count == total and total:
        return loss
    return loss * (count / total if total else 0.0)  # no item in the whole step: its loss is 0/0 anyway


def read_pending(pending: list[Pending], device: torch.device, raise_nonfinite: bool,
                 norms: Sequence[tuple[torch.Tensor, int]] = ()) -> list[tuple[float, float, int, int]]:
    """The pending losses and item counts on the host, as (loss, items, step, micro-batch).
    With ``raise_nonfinite``, raises for the first step whose loss or gradient norm (``norms``:
    (0-d norm, step) pairs, read in the same host read) was not finite: ``NonFiniteLossError``
    naming the micro-batch, or ``NonFiniteGradientError`` when only the gradient was (a
    non-finite loss makes its gradient non-finite too: the loss is named, the cause)."""
    if not pending and not norms:
        return []
    loss_tensors, counts, steps, micros = zip(*pending, strict=True) if pending else ((), (), (), ())
    tensors = [torch.stack(loss_tensors)] if pending else []
    if norms:
        tensors.append(torch.stack([n for n, _ in norms]))
    read = torch.cat([t.to(device, torch.float64) for t in tensors]).tolist()  # one host read for all
    losses, norm_values = read[:len(pending)], read[len(pending):]
    if any(issubclass(kind, torch.Tensor) for kind in set(map(type, counts))):  # token counts on the device
        items = torch.stack([torch.as_tensor(n, device=device) for n in counts]).double().tolist()
    else:
        items = list(map(float, counts))
    values = list(zip(losses, items, steps, micros, strict=True))
    if raise_nonfinite and not (all(map(math.isfinite, losses)) and all(map(math.isfinite, norm_values))):
        check_finite(values, [(v, step) for v, (_, step) in zip(norm_values, norms, strict=True)])
    return values


def check_finite(values: list[tuple[float, float, int, int]], norms: list[tuple[float, int]]) -> None:
    """Raise for the first step whose read loss or gradient norm is not finite (see ``read_pending``)."""
    bad_loss = next(((step, micro, loss, n) for loss, n, step, micro in values if not math.isfinite(loss)), None)
    bad_norm = next(((step, v) for v, step in norms if not math.isfinite(v)), None)
    if bad_norm is not None and (bad_loss is None or bad_norm[0] < bad_loss[0]):
        raise NonFiniteGradientError(*bad_norm)
    if bad_loss is not None:
        step, micro, loss, n = bad_loss
        raise NonFiniteLossError(step, micro, loss, items=n)


class LossBuffer:
    """This rank's training losses not yet in a log row (device tensors, no host read per step),
    and the item-weighted totals of those already logged (the fit's mean training loss,
    ``FitResult.training_loss``).

    ``add`` keeps a loss; ``pop_for_row`` reads every pending loss to the host at once, clears
    them, sums them over the ranks and adds them to the totals (a log row). ``read_checked`` reads
    them without clearing, and raises for a non-finite one under ``nonfinite_loss="raise"``
    (before a save or an evaluation). ``add_norm`` keeps a step's gradient norm until that check
    reads it. ``state_dict`` holds this rank's pending values and the totals (not the norms: every
    save checks them first)."""

    def __init__(self, device: torch.device, raise_nonfinite: bool):
        self.device, self.raise_nonfinite = device, raise_nonfinite
        self.pending: list[Pending] = []
        self.norms: list[tuple[torch.Tensor, int]] = []  # (global gradient norm, step), to check
        self.loss_total, self.items_total = 0.0, 0.0

    def add(self, loss: torch.Tensor, items: int | torch.Tensor, step: int, micro: int) -> None:
        self.pending.append((loss.detach(), items, step, micro))

    def add_norm(self, norm: torch.Tensor, step: int) -> None:
        """Keep step ``step``'s global gradient norm (a 0-d device tensor, not read here) for the
        next read to check."""
        self.norms.append((norm, step))

    def drop_last(self, count: int) -> None:
        """Forget the last ``count`` losses (a step skipped for a non-finite loss or gradient)."""
        del self.pending[len(self.pending) - count:]

    def read_checked(self) -> list[tuple[float, float, int, int]]:
        """This rank's pending (loss, items, step, micro-batch) values on the host; raises
        ``NonFiniteLossError`` for a non-finite one when the fit raises on them (and
        ``NonFiniteGradientError`` for a non-finite gradient norm, if that came first)."""
        values = read_pending(self.pending, self.device, self.raise_nonfinite, self.norms)
        self.norms = []  # all finite: checked
        return values

    def pop_for_row(self, strategy: Any) -> tuple[float, float]:
        """Read and clear the pending losses; their item-weighted loss sum and item count over
        every rank (collective: every rank calls it, with or without losses of its own), added
        to the totals."""
        values = self.read_checked()
        self.pending = []
        loss_sum, item_sum = sum_values(strategy, values)
        self.loss_total += loss_sum
        self.items_total += item_sum
        return loss_sum, item_sum

    def mean_loss(self, strategy: Any) -> float:
        """The whole fit's item-weighted mean loss, counting what is still pending (a run stopped
        in ``on_save`` leaves its last losses unlogged in the checkpoint)."""
        loss, items = self.loss_total, self.items_total
        if self.pending or self.norms:
            more = sum_values(strategy, self.read_checked())
            loss, items = loss + more[0], items + more[1]
        return loss / items if items else float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [list(v) for v in self.read_checked()], "totals": [self.loss_total, self.items_total]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = [(torch.tensor(loss, dtype=torch.float64, device=self.device), n, int(step), int(micro))
                        for loss, n, step, micro in state["pending"]]
        self.norms = []
        self.loss_total, self.items_total = state["totals"]


def sum_values(strategy: Any, values: list[tuple[float, float, int, int]]) -> tuple[float, float]:
    """Item-weighted loss sum and item count of read pending values, over every rank."""
    losses, items, _, _ = zip(*values, strict=True) if values else ((), (), (), ())
    loss_sum, item_sum = sum(map(operator.mul, losses, items)), sum(items)
    return tuple(strategy.collectives.sum_floats([loss_sum, item_sum]))  # type: ignore[return-value]

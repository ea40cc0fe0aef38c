"""Putting a module's buffers back after a skipped step (``nonfinite_loss="skip"``)."""

from __future__ import annotations

import torch
from torch import nn


def snapshot_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of every buffer, taken before a step's forward passes: a forward that produces a
    non-finite loss may already have written it into running statistics (BatchNorm's mean and
    variance), which a skipped step must not keep."""
    return [(b, b.detach().clone()) for b in module.buffers()]


@torch.no_grad()
def restore_buffers(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buffer, saved in snapshot:
        buffer.copy_(saved)

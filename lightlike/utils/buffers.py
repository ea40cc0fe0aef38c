"""Putting a module's buffers back: after a skipped step (``nonfinite_loss="skip"``), and after
activation checkpointing's recompute of a forward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


def snapshot_buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of every buffer, taken before a step's forward passes: a forward that produces a
    non-finite loss may already have written it into running statistics (BatchNorm's mean and
    variance), which a skipped step must not keep."""
    return [(b, b.detach().clone()) for b in module.buffers()]


@torch.no_grad()
def restore_buffers(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buffer, saved in snapshot:
        buffer.copy_(saved)


def buffers_kept_on_recompute(owner: nn.Module) -> Callable[[], tuple[contextlib.AbstractContextManager,
                                                                        contextlib.AbstractContextManager]]:
    """A ``context_fn`` for torch's non-reentrant activation checkpointing. The recompute in
    backward runs the forward a second time; in training mode that would update running
    statistics (BatchNorm's mean, variance and batch count) twice per step, so switching
    checkpointing on would change the trained model. The buffers of ``owner`` that the first
    forward changed are put back after the recompute: those whose version counter moved, and
    the running statistics of the normalisation layers the forward ran in training mode (seen
    by a forward pre-hook held for that call only: torch's batch-norm kernel updates them in place
    without moving their counters). Only layers the checkpointed forward ran: the statistics of
    one outside it (``owner`` is the whole module when a function is checkpointed) are saved for
    its own backward and must not be touched.
    Nothing is copied when there are none."""

    def context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        changed: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            before = [(b, b._version) for b in owner.buffers()]
            ran: list[nn.Module] = []  # norm layers this forward ran in training mode
            hooks = [m.register_forward_pre_hook(lambda m, _: ran.append(m) if m.training else None)
                     for m in owner.modules() if isinstance(m, _NormBase) and m.track_running_stats]
            try:
                yield
            finally:
                for h in hooks:
                    h.remove()
            changed.extend(b for b, version in before if b._version != version)
            seen = {id(b) for b in changed}
            for m in ran:  # the kernel updates the statistics without moving their version counters
                changed.extend(b for b in m.buffers(recurse=False) if id(b) not in seen)
                seen.update(id(b) for b in m.buffers(recurse=False))

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            saved = [(b, b.detach().clone()) for b in changed]
            try:
                yield
            finally:
                restore_buffers(saved)

        return forward(), recompute()

    return context_fn

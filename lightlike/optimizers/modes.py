"""Optimizers with a train and an eval mode (schedule-free's): which weights the module holds.

A schedule-free optimizer keeps the module's weights at the point its gradients are taken while
in train mode, and at the averaged point (the one to evaluate and keep) in eval mode. lightlike,
as the HF Trainer, finds them by their ``train()``/``eval()`` methods. The one rule, kept here:
the step context puts them in train mode before every training step (``train_mode``), and the
Fitter puts them in eval mode before every evaluation, save and prediction, and at the end of a
fit (``eval_mode``), so the module a fit returns, and every checkpoint, hold the averaged weights.
Both calls do nothing to an optimizer already in that mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def has_modes(optimizer: Any) -> bool:
    """Whether ``optimizer`` has ``train()`` and ``eval()`` (a schedule-free optimizer)."""
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


def with_modes(optimizers: Any) -> list[Any]:
    """Those of ``optimizers`` (one, or an iterable of them, or None) that have modes."""
    if optimizers is None:
        return []
    many = optimizers if isinstance(optimizers, Iterable) and not has_modes(optimizers) else [optimizers]
    return [o for o in many if has_modes(o)]


def train_mode(optimizers: Any) -> None:
    """Train mode, for a training step."""
    for o in with_modes(optimizers):
        o.train()


def eval_mode(optimizers: Any) -> None:
    """Eval mode, for an evaluation, a prediction, a save, and the end of a fit."""
    for o in with_modes(optimizers):
        o.eval()

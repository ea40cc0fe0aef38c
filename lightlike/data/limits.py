"""``limit_train_batches`` / ``limit_val_batches``: how many of a loader's batches are used, as
Lightning counts them (per process: the first N of this rank's batches, or a fraction of them).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from lightlike.errors import ConfigError

if TYPE_CHECKING:
    from lightlike.config import FitConfig
    from lightlike.data.loading import TrainData

log = logging.getLogger("lightlike")


def batch_limit(limit: int | float | None, length: int | None, setting: str, what: str) -> int | None:
    """The batches to use of a loader of ``length`` batches on this process (None: all): an int
    limit is a count (at most ``length``), a float the fraction ``int(length * limit)``. A float
    on a loader without a length, or one that leaves no batch of a nonempty loader, is a
    ``ConfigError`` naming ``setting``."""
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return None
    if isinstance(limit, int):
        return limit if length is None else min(length, limit)
    if length is None:
        raise ConfigError(f"{setting}={limit!r} is a fraction of the {what} batches, whose number is not known: "
                          f"the data has no length (an IterableDataset); give {setting} a number of batches (an int)",
                          settings=(setting,))
    n = int(length * limit)
    if n == 0 and limit > 0 and length > 0:
        raise ConfigError(f"{setting}={limit!r} of the {length} {what} batches of this process is less than one "
                          f"batch: raise it to at least {1 / length:.6g}, or give a number of batches (an int)",
                          settings=(setting,))
    return n


def loader_length(loader: Any) -> int | None:
    """``len(loader)``; None when it has none."""
    try:
        return len(loader)
    except TypeError:
        return None


class TrainLimit:
    """``limit_train_batches`` resolved for this fit: the micro-batches each epoch takes on every
    process (``per_epoch``; None: all). An epoch ends there, as when its data runs out (the
    epoch's position says so: ``EpochPosition.advance``)."""

    def __init__(self, config: FitConfig, train_data: TrainData):
        limit = config.limit_train_batches
        length = train_data.batches_per_epoch() if limit is not None else None  # (the same on every rank)
        self.per_epoch = batch_limit(limit, length, "limit_train_batches", "training")
        train_data.batch_limit = self.per_epoch

    def watch(self, batches: Any, taken: int) -> Any:
        """The epoch's batches after ``taken`` of them, up to the limit."""
        return batches if self.per_epoch is None else itertools.islice(batches, max(0, self.per_epoch - taken))


def eval_limit(config: FitConfig, loader: Any, name: str) -> int | None:
    """``limit_val_batches`` for evaluation set ``name``'s loader: this process's batches to evaluate."""
    return batch_limit(config.limit_val_batches, loader_length(loader), "limit_val_batches", f"{name!r} evaluation")


def eval_limits(config: FitConfig, eval_sets: dict[str, Any], limited: bool = True) -> list[tuple[str, Any, int | None]]:
    """(name, loader, this process's batches to evaluate) of each set; with ``limited=False``
    (``test``, ``predict``) every batch. ``limit_val_batches=0`` leaves no set (``limited_eval_sets``)."""
    if not limited:
        return [(name, loader, None) for name, loader in eval_sets.items()]
    return [(name, loader, eval_limit(config, loader, name))
            for name, loader in limited_eval_sets(config, eval_sets).items()]


def limited_eval_sets(config: FitConfig, eval_sets: dict[str, Any]) -> dict[str, Any]:
    """The evaluation sets of a fit: none with ``limit_val_batches=0`` (said once); each set's
    limit checked against its loader now, before any step."""
    if config.limit_val_batches == 0 and eval_sets:
        log.info("limit_val_batches=0: nothing is evaluated (the evaluation sets %s are not read)",
                 ", ".join(map(repr, eval_sets)))
        return {}
    for name, loader in eval_sets.items():
        eval_limit(config, loader, name)
    return eval_sets


def capped(count: int | None, limit: int | None) -> int | None:
    """``count`` batches, at most ``limit`` (None: no limit; a count of None stays unknown, or the limit)."""
    if limit is None:
        return count
    return limit if count is None else min(count, limit)


def limited(batches: Any, limit: int | None) -> Any:
    """The first ``limit`` of ``batches`` (all with None)."""
    return batches if limit is None else itertools.islice(batches, limit)

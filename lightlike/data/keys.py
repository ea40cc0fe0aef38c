"""``remove_unused_keys``: drop the batch keys a module does not read (the HF Trainer's
``remove_unused_columns``), so strings, ids and other passengers never reach the device."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from torch.utils.data import default_collate, get_worker_info

from lightlike.errors import DataError
from lightlike.module import TaskModule

log = logging.getLogger("lightlike")

#: kept even when the module's signature does not name them: the loss reads them, and
#: ``TaskModule.labels`` looks for them (the HF Trainer keeps its label columns alike)
LABEL_KEYS = ("labels", "label", "label_ids", "y", "target", "targets")


def module_batch_keys(module: Any) -> frozenset[str]:
    """The batch keys ``module`` reads: its ``batch_keys`` attribute when declared, else the
    parameter names of its ``forward`` (or of the callable itself), ``*args``/``**kwargs``
    excepted, as the HF Trainer reads a model's signature."""
    declared = getattr(module, "batch_keys", None)
    name = getattr(type(module), "__name__", repr(module))
    if declared is not None:
        if isinstance(declared, str) or not all(isinstance(k, str) for k in declared):
            raise TypeError(f"{name}.batch_keys must be a collection of key names (strings), got {declared!r}")
        return frozenset(declared)

    if isinstance(module, TaskModule):
        raise DataError(
            f"cannot tell which batch keys {name} reads: a TaskModule's forward takes the whole batch. "
            f"Declare them on the class (batch_keys = ('input_ids', 'attention_mask', 'labels')), or pass "
            "the wrapped model whose forward names them (remove_unused_keys(module.model, collator))"
        )
    fn = module.forward if hasattr(module, "forward") else module
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise DataError(f"cannot read the signature of {name}: declare batch_keys on it") from e
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = frozenset(p.name for p in params if p.kind in kinds)
    if not names:
        raise DataError(f"{name}.forward names no parameters (only *args/**kwargs): declare batch_keys on it")
    return names


class KeyFilter:
    """Wraps a collate function; keeps only ``keys`` of each batch it makes. Picklable (for
    DataLoader workers) when the wrapped function is. Logs the keys it drops the first time it
    drops them, in the process that collates: the main process, or worker 0 of a DataLoader's
    workers (other workers stay quiet; workers restarted each epoch report again)."""

    def __init__(self, collate_fn: Callable[[Any], Any], keys: Collection[str], reader: str = "the module") -> None:
        self.collate_fn = collate_fn
        self.keys = frozenset(keys)
        self.reader = reader
        self._reported: set[str] = set()

    def __call__(self, items: Any) -> dict[str, Any]:
        return self.filter(self.collate_fn(items))

    def filter(self, batch: Any) -> dict[str, Any]:
        if not isinstance(batch, Mapping):
            raise DataError(f"remove_unused_keys works on dict batches; the collate function returned a "
                            f"{type(batch).__name__}")
        kept = {k: v for k, v in batch.items() if k in self.keys}
        dropped = [k for k in batch if k not in self.keys]
        if not kept:
            raise DataError(f"remove_unused_keys would drop every key of the batch {sorted(batch)}: "
                            f"{self.reader} reads {sorted(self.keys)}. Fix the keys the module declares or "
                            "the collator")
        new = [k for k in dropped if k not in self._reported]
        if new:
            self._reported.update(new)
            worker = get_worker_info()
            if worker is not None and worker.id != 0:
                return kept
            log.info("remove_unused_keys: dropping batch key(s) %s, which %s does not read (it reads %s)",
                     sorted(new), self.reader, sorted(k for k in self.keys if k in batch))
        return kept


def remove_unused_keys(module: Any, batch_or_collator: Any = None, *,
                       keep: Collection[str] = LABEL_KEYS) -> Any:
    """Drop the batch keys ``module`` does not read.

    The keys read are ``module.batch_keys`` when set (a ``TaskModule`` declares them: its
    ``forward(batch)`` takes the whole batch), else the parameter names of ``module.forward``
    (an HF-style model, ``forward(input_ids, attention_mask=None, labels=None)``), plus
    ``keep`` (label keys by default, since the loss reads them).

    ``batch_or_collator``: a collate function (or ``None`` for torch's ``default_collate``)
    returns a wrapped collate function for a DataLoader; a dict batch returns the filtered dict.
    Dropped keys are logged once, at INFO, on the ``lightlike`` logger.
    """
    keys = module_batch_keys(module) | frozenset(keep)
    reader = getattr(type(module), "__name__", "the module")
    if batch_or_collator is None:
        batch_or_collator = default_collate
    if isinstance(batch_or_collator, Mapping):
        return KeyFilter(_identity, keys, reader).filter(batch_or_collator)
    if callable(batch_or_collator):
        return KeyFilter(batch_or_collator, keys, reader)
    raise TypeError(f"remove_unused_keys takes a dict batch or a collate function, got "
                    f"{type(batch_or_collator).__name__}")


def _identity(x: Any) -> Any:
    return x

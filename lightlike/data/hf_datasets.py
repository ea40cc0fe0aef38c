"""Hugging Face ``datasets`` as they come, and the collator a module names.

A ``datasets.Dataset`` (map-style) or ``datasets.IterableDataset`` (streaming) goes straight into
``fit``/``validate``/``test``/``predict``:

* with ``remove_unused_columns=True`` the columns the module does not read are dropped from each
  item before collation (its ``batch_keys``: for ``HFModel``/``HFCausalLM`` the model's forward
  signature; ``label`` and ``label_ids`` are kept), logged once per set; a module without
  ``batch_keys`` keeps every column;
* items are collated by the module's ``data_collator`` (an attribute or method taking the list of
  items) when it has one, else by ``HFCollator`` (no pad token: variable lengths are an error);
* a streaming dataset is read as it is on one process; on several, ``split_dataset_by_node``
  gives each rank its share for training (its DataLoader workers split it further, as ``datasets``
  does), and evaluation reads it in the main process, each rank keeping its round-robin share.

A module's ``data_collator`` collates any dataset lightlike builds a loader for (not a DataLoader
of the user's). This module imports ``datasets`` only where the object passed is already one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import get_worker_info

from lightlike.data.collators import PaddingCollator
from lightlike.errors import ConfigError, DataError

log = logging.getLogger("lightlike")

#: label columns kept by ``remove_unused_columns`` and renamed to ``labels`` (the HF Trainer's)
LABEL_COLUMNS = ("label", "label_ids")


def is_hf_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.Dataset`` or ``datasets.IterableDataset``."""
    ds = sys.modules.get("datasets")
    return ds is not None and isinstance(data, (ds.Dataset, ds.IterableDataset))


def is_hf_iterable(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.IterableDataset`` (streaming)."""
    ds = sys.modules.get("datasets")
    return ds is not None and isinstance(data, ds.IterableDataset)


class CollateError(DataError):
    """A batch that cannot be made; the message names the column and what to change."""


class HFCollator:
    """Batches items as transformers' data collators do: ``label``/``label_ids`` become
    ``labels``; numbers and lists of numbers become tensors (no ``set_format("torch")``
    needed); sequences of different lengths are padded (``input_ids`` with ``pad_token_id``,
    labels with -100, other fields with 0; an ``attention_mask`` is added where padding was
    needed and the items have none); strings are passed on as lists. Without ``pad_token_id``,
    ``input_ids`` of different lengths are an error naming the column and what to give."""

    def __init__(self, pad_token_id: int | None = None, padding_side: str = "right") -> None:
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.padder = PaddingCollator(0 if pad_token_id is None else pad_token_id, padding_side=padding_side)

    def __call__(self, items: Any) -> Any:
        if not items or not all(isinstance(item, Mapping) for item in items):
            from torch.utils.data import default_collate

            return default_collate(items)
        items = [_renamed(item) for item in items]
        ids = items[0].get("input_ids")
        ragged = False
        if ids is not None and not isinstance(ids, (str, bytes)) and hasattr(ids, "__len__"):
            lengths = {len(item["input_ids"]) for item in items}
            ragged = len(lengths) > 1
            if ragged and self.pad_token_id is None:
                raise CollateError(f"column 'input_ids' holds sequences of different lengths {sorted(lengths)} in one "
                                "batch and no pad token is known: give the module one (HFModel(model, tokenizer=...) "
                                "or pad_token_id=...), or a data_collator that pads, or pad the dataset")
        batch = self.padder(items)
        if not ragged and "attention_mask" not in items[0]:
            batch.pop("attention_mask", None)  # nothing was padded: the items' own fields, no more
        return batch


def _renamed(item: Mapping[str, Any]) -> dict[str, Any]:
    """``item`` with ``label``/``label_ids`` as ``labels`` (transformers' default_data_collator)."""
    present = [k for k in LABEL_COLUMNS if k in item]
    if not present:
        return dict(item)
    if len(present) > 1 or "labels" in item:
        raise DataError(f"the items have label columns {sorted([*present, *(['labels'] if 'labels' in item else [])])}"
                        ": keep one (dataset.remove_columns([...])); 'label' and 'label_ids' are renamed 'labels'")
    out = {k: v for k, v in item.items() if k != present[0]}
    out["labels"] = item[present[0]]
    return out


class DatasetCollate:
    """The collate function of a loader lightlike builds: drops the columns not in ``keep``
    (None: none) from each item, then calls ``collate``. A collation error names the set and
    what to change. Picklable when ``collate`` is (DataLoader workers)."""

    def __init__(self, collate: Callable[[Any], Any], keep: Collection[str] | None, what: str, dropping: bool):
        self.collate = collate
        self.keep = None if keep is None else frozenset(keep)
        self.what = what
        self.dropping = dropping  # whether the dropped columns are still to be logged (unknown at set-up)
        self._reported: set[str] = set()

    def __call__(self, items: Any) -> Any:
        if self.keep is not None:
            items = [self._kept(item) for item in items]
        try:
            return self.collate(items)
        except CollateError:
            raise
        except DataError as e:
            raise CollateError(f"the {self.what} dataset's items cannot be batched: {e}. Drop or fix that column "
                            "(dataset.remove_columns([...]); remove_unused_columns=True drops the columns the model "
                            "does not take), or give the module a data_collator that batches it") from e

    def _kept(self, item: Any) -> Any:
        if not isinstance(item, Mapping):
            return item
        kept = {k: v for k, v in item.items() if k in self.keep}  # type: ignore[operator]
        if self.dropping and len(kept) < len(item):
            new = [k for k in item if k not in kept and k not in self._reported]
            if new:
                self._reported.update(new)
                worker = get_worker_info()
                if worker is None or worker.id == 0:
                    log.info("remove_unused_columns: dropping column(s) %s of the %s dataset, which the module does "
                             "not read (set remove_unused_columns=False to keep them)", new, self.what)
        return kept


@dataclass
class LoaderInputs:
    """What lightlike builds a loader from: the dataset, its collate function (None: the
    default), the DataLoader workers, and whether the dataset splits itself over them."""

    data: Any
    collate_fn: Callable[[Any], Any] | None
    num_workers: int
    shards_itself: bool = False


def module_collator(module: Any) -> Callable[[Any], Any] | None:
    """The module's ``data_collator`` (an attribute or method), or None."""
    collator = getattr(module, "data_collator", None) if module is not None else None
    if collator is not None and not callable(collator):
        raise ConfigError(f"{type(module).__name__}.data_collator is a {type(collator).__name__}: make it a callable "
                          "that takes the list of items and returns the batch (or remove it)")
    return collator


def loader_inputs(data: Any, module: Any, *, what: str, num_workers: int, remove_unused_columns: bool = True,
                  training: bool = True, rank: int = 0, world_size: int = 1) -> LoaderInputs:
    """``data`` as lightlike's loader reads it (module docstring): a Hugging Face dataset's
    columns dropped and collated, any other dataset collated by the module's ``data_collator``."""
    collator = module_collator(module)
    if not is_hf_dataset(data):
        return LoaderInputs(data, collator, num_workers, bool(getattr(data, "shards_itself", False)))
    keep = _kept_columns(module) if remove_unused_columns else None
    columns = getattr(data, "column_names", None)
    dropping = keep is not None and columns is None
    if keep is not None and columns is not None:
        dropped = [c for c in columns if c not in keep]
        if dropped:
            log.info("remove_unused_columns: dropping column(s) %s of the %s dataset, which %s does not read (it "
                     "reads %s; set remove_unused_columns=False to keep them)", dropped, what, type(module).__name__,
                     sorted(c for c in columns if c in keep))
        if len(dropped) == len(columns):
            raise DataError(f"remove_unused_columns would drop every column of the {what} dataset {columns}: "
                            f"{type(module).__name__} reads {sorted(keep)}. Rename the columns (dataset."
                            "rename_column) or set remove_unused_columns=False")
        keep = keep if dropped else None
    collate = DatasetCollate(collator or HFCollator(), keep, what, dropping)
    if not is_hf_iterable(data):
        return LoaderInputs(data, collate, num_workers)
    if not training:  # read in order in the main process; ShardedIterable deals each rank its items
        if num_workers > 0:
            log.info("the %s datasets.IterableDataset is read in the main process (num_workers=0): it splits "
                     "itself over DataLoader workers, which would change its order", what)
        return LoaderInputs(data, collate, 0)
    if world_size > 1:
        from datasets.distributed import split_dataset_by_node

        data = split_dataset_by_node(data, rank=rank, world_size=world_size)
    return LoaderInputs(data, collate, num_workers, shards_itself=True)


def _kept_columns(module: Any) -> frozenset[str] | None:
    """The columns the module reads (its ``batch_keys`` plus the label columns); None when it
    does not say (a TaskModule without ``batch_keys``: every column is kept, as before)."""
    keys = getattr(module, "batch_keys", None)
    if keys is None:
        return None
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{type(module).__name__}.batch_keys must be a collection of column names, got {keys!r}")
    return frozenset(keys) | frozenset(LABEL_COLUMNS)


def set_dataset_epoch(dataset: Any, epoch: int) -> None:
    """Call the streaming dataset's own ``set_epoch(epoch)`` (a ``datasets.IterableDataset``
    reshuffles with ``seed + epoch``), also through lightlike's ``ShardedIterable``."""
    inner = getattr(dataset, "dataset", None)
    if inner is not None and not hasattr(dataset, "set_epoch"):
        dataset = inner
    set_epoch = getattr(dataset, "set_epoch", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) and callable(set_epoch):
        set_epoch(epoch)

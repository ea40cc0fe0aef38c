"""The reads of the loaders lightlike builds from a map-style Dataset, with errors that name the item.

torch's default collate fails with ``KeyError: 'y'`` (an item without a key the first one has),
``stack expects each tensor to be equal size, but got [3] at entry 0 and [4] at entry 1``, or
keeps only the first item's keys (a key the others have is dropped without a word); a dataset
whose ``__len__`` counts more items than ``__getitem__`` serves fails with the IndexError of
whatever ``__getitem__`` indexes. Here:

- ``CheckedDataset`` reads the items as the DataLoader would (``__getitems__`` where the
  dataset has one, else item by item) and hands the collate function the items with their
  dataset indices; an ``IndexError`` becomes a ``DataError`` naming the index and ``__len__``.
- ``DefaultCollate`` is torch's ``default_collate``, after a check that every item has the
  first one's keys; where it fails, the first difference between the items (keys, lengths,
  shapes, kinds) is named with the items' dataset indices: ``dataset[3]['x'] has shape (3,) but
  dataset[5]['x'] has shape (4,)``. A failure with no such difference is torch's, unchanged.

Both are picklable (DataLoader workers). Loaders of your own (a DataLoader passed to ``fit``)
are read as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from lightlike.errors import DataError


class IndexedItems(list):
    """A batch's items, as read, with their dataset indices (``indices``, set by the reader)."""

    __slots__ = ("indices",)
    indices: Sequence[int]


def indexed(items: Any, indices: Sequence[int]) -> IndexedItems:
    """``items`` (an iterable) as an ``IndexedItems`` list read from ``indices``."""
    batch = IndexedItems(items)
    batch.indices = indices
    return batch


class CheckedDataset(Dataset):
    """``dataset`` as lightlike's loaders read it: the same items (``dataset`` is the one
    wrapped; other attributes are read from it); a read past the real end names the index and
    what ``__len__`` says."""

    def __init__(self, dataset: Any, what: str):
        self.dataset = dataset
        self.what = what  # "training", "val", ...: the data the messages name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        try:
            return self.dataset[index]
        except IndexError as e:
            raise self._past_the_end(f"dataset[{index!r}]", e) from e

    def __getitems__(self, indices: list[int]) -> list[Any]:
        read_batch = getattr(self.dataset, "__getitems__", None)
        if read_batch is not None:  # the dataset's own batched read (HF datasets have one)
            try:
                items = read_batch(indices)
            except IndexError as e:
                raise self._past_the_end(f"dataset.__getitems__({indices})", e) from e
            return indexed(items, indices) if isinstance(items, list) else items
        dataset = self.dataset
        try:  # one read per item, with no frame of ours around each
            batch = IndexedItems([dataset[i] for i in indices])
        except IndexError:
            for i in indices:  # which one: the first that fails again names the index
                self[i]
            raise
        batch.indices = indices
        return batch

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "what"):  # (unpickling: not set yet)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _past_the_end(self, read: str, error: IndexError) -> DataError:
        n = len(self.dataset)
        return DataError(f"the {self.what} dataset's __len__() says {n} items, but {read} raised IndexError: "
                         f"{error}. Make __len__ return the number of items __getitem__ serves (indices 0 to {n - 1})")


class DefaultCollate:
    """torch's ``default_collate`` with errors that name the items (module docstring)."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self, items: list[Any]) -> Any:
        if items and not _same_key_counts(items) and isinstance(items[0], Mapping):
            # default_collate keeps the first item's keys only: a key the others have would be dropped
            if (problem := _key_difference(items, _namer(items), "")) is not None:
                raise self._error(problem)
        try:
            batch = default_collate(items)
        except (RuntimeError, TypeError, KeyError, ValueError, IndexError) as e:
            problem = _difference(items, _namer(items), "")
            if problem is None:
                raise
            raise self._error(problem) from e
        # a batch of strings (or other items torch leaves as a list) is the items' list itself
        return list(batch) if type(batch) is IndexedItems else batch

    def _error(self, problem: str) -> DataError:
        return DataError(f"the {self.what} items of one batch cannot be collated: {problem}. torch's default collate "
                         "needs the same keys, lengths and shapes in every item: make them so, or pass a DataLoader "
                         "with a collate_fn of your own (lightlike.data.PaddingCollator pads variable lengths)")


def _same_key_counts(items: list[Any]) -> bool:
    """Whether every item has as many keys as the first (this runs for every batch, in C).
    Enough to see an item with a key the first lacks, which ``default_collate`` would drop: an
    item with as many keys but other ones lacks one of the first's, and ``default_collate``
    raises ``KeyError`` for it, which ``DefaultCollate`` names the same way."""
    try:
        return len(set(map(len, items))) == 1
    except TypeError:  # an item without a length: _key_difference names it
        return False


def _namer(items: list[Any]) -> Any:
    indices = getattr(items, "indices", None)
    if indices is not None and len(indices) == len(items):
        return lambda k: f"dataset[{indices[k]}]"
    return lambda k: f"item {k} of the batch"


def _key_difference(values: list[Any], names: Any, path: str) -> str | None:
    keys = values[0].keys()
    for k, value in enumerate(values[1:], 1):
        if not isinstance(value, Mapping):
            return f"{names(0)}{path} is a mapping but {names(k)}{path} is a {type(value).__name__}"
        if value.keys() != keys:
            missing, extra = [key for key in keys if key not in value], [key for key in value if key not in keys]
            diff = ", ".join(part for part in (f"missing {missing}" if missing else "",
                                              f"extra {extra}" if extra else "") if part)
            return (f"{names(0)}{path} has keys {_listed(keys)} but {names(k)}{path} has keys {_listed(value.keys())} "
                    f"({diff})")
    return None


def _listed(keys: Any) -> list[Any]:
    try:
        return sorted(keys)
    except TypeError:
        return list(keys)


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return tuple(value.shape)
    return None


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return "array"
    if isinstance(value, (str, bytes)):
        return "string"
    if isinstance(value, Sequence):
        return "sequence"
    return type(value).__name__


def _difference(values: list[Any], names: Any, path: str) -> str | None:
    """The first difference between the items' values at ``path`` that the default collate
    cannot join (keys, kinds, lengths, shapes), or None."""
    first = values[0]
    kind = _kind(first)
    for k, value in enumerate(values[1:], 1):
        other = _kind(value)
        if other != kind and {kind, other} != {"int", "float"}:
            return (f"{names(0)}{path} is a {type(first).__name__} but {names(k)}{path} is a "
                    f"{type(value).__name__}")
    if kind == "mapping":
        problem = _key_difference(values, names, path)
        if problem is not None:
            return problem
        for key in first:
            if (problem := _difference([v[key] for v in values], names, f"{path}[{key!r}]")) is not None:
                return problem
    elif kind == "array":
        shape = _shape(first)
        for k, value in enumerate(values[1:], 1):
            if _shape(value) != shape:
                return f"{names(0)}{path} has shape {shape} but {names(k)}{path} has shape {_shape(value)}"
    elif kind == "sequence":
        for k, value in enumerate(values[1:], 1):
            if len(value) != len(first):
                return f"{names(0)}{path} has {len(first)} elements but {names(k)}{path} has {len(value)}"
        for i in range(len(first)):
            if (problem := _difference([v[i] for v in values], names, f"{path}[{i}]")) is not None:
                return problem
    return None

"""Per-batch outputs joined into dataset order (predictions and labels of ``predict`` and of
evaluations with ``compute_metrics``): padded to one shape, kept as the module's own types (at
any depth: mappings, dataclasses, namedtuples), one row per item (per-batch values are refused),
and conformed across ranks."""

from __future__ import annotations

import dataclasses
import pickle
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightlike.errors import ModuleContractError
from lightlike.utils.batches import map_tensors

#: what tensors of predictions and labels are padded with where batches differ in size (the HF
#: Trainer's -100; False for bool and 0 for unsigned integer tensors)
PAD_VALUE = -100


def concat(chunks: list[Any], what: str = "predictions") -> Any:
    """Join per-batch outputs along the batch dimension; tensors are padded to the largest
    size of each other dimension with ``PAD_VALUE``."""
    if not chunks:
        return None
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        tensors = [c.reshape(1) if c.ndim == 0 else c for c in chunks]
        shape = _max_shape([tuple(t.shape[1:]) for t in tensors], what)
        return torch.cat([_pad(t, shape) for t in tensors])
    if isinstance(first, Mapping):
        return rebuild(type(first), {k: concat([c[k] for c in chunks], f"{what}[{k!r}]") for k in first})
    if _is_record(first):  # a dataclass: its fields joined, as a mapping's values are
        return rebuild(type(first), {k: concat([getattr(c, k) for c in chunks], f"{what}.{k}")
                                     for k in _record_fields(first)})
    if isinstance(first, tuple):  # fields (logits, hidden), each joined, as the HF Trainer's nested_concat does
        return _tuple_like(first, [concat([c[j] for c in chunks], f"{what}[{j}]") for j in range(len(first))])
    out: list[Any] = []  # a list: one value per item
    for c in chunks:
        out.extend(c if isinstance(c, (list, tuple)) else [c])
    return out


def leaf_rows(chunk: Any) -> list[int]:
    """The rows one batch's outputs add to each field ``concat`` joins, in ``concat``'s order."""
    if isinstance(chunk, torch.Tensor):
        return [1 if chunk.ndim == 0 else chunk.shape[0]]
    if isinstance(chunk, Mapping):
        return [n for v in chunk.values() for n in leaf_rows(v)]
    if _is_record(chunk):
        return [n for k in _record_fields(chunk) for n in leaf_rows(getattr(chunk, k))]
    if isinstance(chunk, tuple):
        return [n for v in chunk for n in leaf_rows(v)]
    return [len(chunk) if isinstance(chunk, list) else 1]


def in_batch_order(joined: Any, rows: list[list[list[int]]]) -> Any:
    """Outputs joined rank by rank (plain dicts and tuples, see ``conform``) put in the order of
    batches dealt round-robin: rank r's batch j is batch ``j * W + r`` of the set (a DataLoader
    whose elements are ready-made batches). ``rows[r][j]``: that batch's ``leaf_rows``."""
    world = len(rows)
    fields = next((len(batch) for rank in rows for batch in rank), 0)
    orders = []
    for k in range(fields):
        starts: list[list[tuple[int, int]]] = []
        offset = 0
        for rank in rows:  # where each batch's rows of field k begin in the rank-by-rank join
            starts.append([])
            for batch in rank:
                starts[-1].append((offset, batch[k]))
                offset += batch[k]
        order: list[int] = []
        for g in range(sum(len(rank) for rank in rows)):
            first, n = starts[g % world][g // world]
            order.extend(range(first, first + n))
        orders.append(order)
    return _take(joined, iter(orders))


def _take(x: Any, orders: Iterator[list[int]]) -> Any:
    """Each field of ``x`` (in ``leaf_rows``'s order) with its rows in the next order's order."""
    if isinstance(x, dict):
        return {k: _take(v, orders) for k, v in x.items()}
    if isinstance(x, tuple):
        return _tuple_like(x, [_take(v, orders) for v in x])
    order = next(orders)
    if isinstance(x, torch.Tensor):
        return x[torch.tensor(order, dtype=torch.long)]
    return [x[i] for i in order]


def _tuple_like(model: tuple, fields: list[Any]) -> tuple:
    return type(model)(*fields) if hasattr(model, "_fields") else tuple(fields)


def _is_record(x: Any) -> bool:
    """A dataclass instance that is not a mapping (a Hugging Face ModelOutput is both: a mapping)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and not isinstance(x, Mapping)


def _record_fields(x: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(x) if hasattr(x, f.name)]  # an init=False one may be unset


def rebuild(cls: Any, fields: dict[str, Any]) -> Any:
    """Joined ``fields`` as an instance of the module's own mapping or dataclass type ``cls``
    (a ModelOutput stays one, so ``predictions.logits`` works); the plain dict where ``cls`` is
    unknown (it could not travel between ranks) or cannot be built from them. A dataclass is
    made without its ``__init__``/``__post_init__``: they ran on every batch's values already,
    and again on joined ones they would transform them twice (or refuse a whole set)."""
    if cls is None or cls in (dict, defaultdict):
        return fields
    try:
        if issubclass(cls, Mapping):
            return cls(fields)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return fields
        out = object.__new__(cls)
        for k, v in fields.items():  # init=False fields too
            object.__setattr__(out, k, v)  # frozen ones too
        return out
    except Exception:  # a constructor that wants other arguments: the joined fields as they are
        return fields


def _max_shape(shapes: list[tuple[int, ...]], what: str) -> tuple[int, ...]:
    if len({len(s) for s in shapes}) > 1:
        raise ModuleContractError(
            f"{what} have a different number of dimensions in different batches ({sorted(set(shapes))}); "
            "return tensors with the batch first and the same number of dimensions for every batch")
    return tuple(max(sizes) for sizes in zip(*shapes, strict=True))


def _pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` (batch first) padded with ``PAD_VALUE`` at the end of each other dimension."""
    if tuple(t.shape[1:]) == shape:
        return t
    value: int | bool = False if t.dtype == torch.bool else 0 if _unsigned(t.dtype) else PAD_VALUE
    out = t.new_full((t.shape[0], *shape), value)
    out[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
    return out


def _unsigned(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool and \
        torch.iinfo(dtype).min == 0


def spec_of(x: Any) -> Any:
    """What other ranks need to know of a rank's joined outputs to pad theirs alike."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape[1:]))
    if isinstance(x, Mapping):
        return ("dict", {k: spec_of(v) for k, v in x.items()}, _type_to_share(x))
    if _is_record(x):
        return ("dict", {k: spec_of(getattr(x, k)) for k in _record_fields(x)}, _type_to_share(x))
    if isinstance(x, tuple):  # a namedtuple's type travels as a mapping's does
        return ("tuple", [spec_of(v) for v in x], _type_to_share(x) if hasattr(x, "_fields") else None)
    return None if x is None else ("list",)


def merge_specs(specs: list[Any], what: str) -> Any:
    known = [s for s in specs if s is not None]
    if not known:
        return None
    if len({s[0] for s in known}) > 1:
        raise ModuleContractError(f"{what} are of different kinds on different ranks ({sorted({s[0] for s in known})})")
    if known[0][0] == "tensor":
        return ("tensor", known[0][1], _max_shape([s[2] for s in known], what))
    if known[0][0] == "dict":
        keys = [k for k in known[0][1]]
        return ("dict", {k: merge_specs([s[1].get(k) for s in known], f"{what}[{k!r}]") for k in keys}, known[0][2])
    if known[0][0] == "tuple":
        if len({len(s[1]) for s in known}) > 1:
            raise ModuleContractError(f"{what} are tuples of different lengths on different ranks")
        return ("tuple", [merge_specs([s[1][j] for s in known], f"{what}[{j}]") for j in range(len(known[0][1]))],
                known[0][2])
    return known[0]


def conform(x: Any, spec: Any) -> Any:
    """``x`` padded to the merged ``spec``, in the form that travels between ranks (mappings and
    dataclasses as plain dicts, namedtuples as tuples; ``restore`` rebuilds their types); a rank
    with nothing gets an empty part of that form."""
    if spec is None:
        return x
    if spec[0] == "tensor":
        return torch.empty((0, *spec[2]), dtype=spec[1]) if x is None else _pad(x, spec[2])
    if spec[0] == "dict":
        return {k: conform(_field(x, k), sub) for k, sub in spec[1].items()}
    if spec[0] == "tuple":
        return tuple(conform(None if x is None else x[j], sub) for j, sub in enumerate(spec[1]))
    return [] if x is None else x


def _field(x: Any, key: str) -> Any:
    if x is None:
        return None
    return x.get(key) if isinstance(x, Mapping) else getattr(x, key, None)


def restore(x: Any, spec: Any) -> Any:
    """Gathered outputs (plain dicts, see ``conform``) with the module's mapping and dataclass
    types rebuilt at every depth, as ``concat`` keeps them on one process."""
    if x is None or spec is None:
        return x
    if spec[0] == "dict":
        return rebuild(spec[2], {k: restore(v, spec[1].get(k)) for k, v in x.items()})
    if spec[0] == "tuple":
        fields = [restore(v, sub) for v, sub in zip(x, spec[1], strict=True)]
        return spec[2](*fields) if spec[2] is not None else tuple(fields)
    return x


def rows_only(pred: Any, where: str) -> Any:
    """Predictions hold one row per item. A Hugging Face ModelOutput's ``loss`` is the batch's
    loss, not a row: it is left out, as the HF Trainer leaves it out (by name, so every batch
    keeps the same fields). Any other 0-d tensor beside a field of two or more rows is a
    per-batch value too, with no place in dataset order: refused, naming the fix. (A 0-d field
    beside one-row fields, such as ``squeeze()`` on a batch of one item, stays that item's row.)"""
    if not isinstance(pred, (Mapping, tuple)) and not _is_record(pred):
        return pred
    pred = _without_hf_loss(pred)  # the rest is checked as any mapping
    tensors = list(_leaves(pred, ""))  # nested fields too: one batch, one number of rows
    if any(v.ndim > 0 and len(v) > 1 for _, v in tensors):
        scalar = [k for k, v in tensors if v.ndim == 0]
        if scalar:
            raise ModuleContractError(
                f"predictions(){scalar[0]} is a 0-d tensor beside fields of one row per item {where}: a "
                "per-batch value (such as a loss) has no place in dataset order; return only the per-item "
                "fields from predictions() (for a Hugging Face (loss, logits) tuple: outputs[1:])")
    return pred


def _without_hf_loss(x: Any) -> Any:
    """``x`` without the ``loss`` of any Hugging Face ModelOutput in it (at any depth: in mappings,
    tuples and dataclasses); the same object where there is none."""
    if isinstance(x, Mapping):
        hf = type(x).__module__.startswith("transformers.")
        items = {k: _without_hf_loss(v) for k, v in x.items() if not (hf and k == "loss")}
        return x if len(items) == len(x) and all(items[k] is x[k] for k in items) else rebuild(type(x), items)
    if isinstance(x, tuple):
        fields = [_without_hf_loss(v) for v in x]
        return x if all(a is b for a, b in zip(fields, x, strict=True)) else _tuple_like(x, fields)
    if _is_record(x):
        values = {k: _without_hf_loss(getattr(x, k)) for k in _record_fields(x)}
        return x if all(v is getattr(x, k) for k, v in values.items()) else rebuild(type(x), values)
    return x


def _leaves(x: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor field of nested mappings, dataclasses and tuples (a
    list holds one value per item: its 0-d tensors are items)."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, (Mapping, tuple)):
        for k, v in (x.items() if isinstance(x, Mapping) else enumerate(x)):
            yield from _leaves(v, f"{path}[{k!r}]")
    elif _is_record(x):
        for k in _record_fields(x):
            yield from _leaves(getattr(x, k), f"{path}.{k}")


def _type_to_share(x: Any) -> Any:
    """A mapping's type, for other ranks to rebuild it; None (a plain dict) if it cannot travel."""
    try:
        pickle.dumps(type(x))
    except Exception:
        return None
    return type(x)


def detach_cpu(x: Any) -> Any:
    return map_tensors(x, lambda t: t.detach().to("cpu"))  # namedtuples too (rebuilt field by field)

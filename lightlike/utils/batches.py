"""Walking a (nested) batch: the one place that knows which containers a batch may be made of."""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor],
                other: Callable[[Any], Any] | None = None) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, through mappings, namedtuples, lists,
    tuples and dataclass instances, each kept as its own type (as Lightning's
    ``apply_to_collection`` does): a dict or ``UserDict`` (subclasses too) is copied and its
    values replaced, so what else it holds stays (a ``defaultdict``'s factory, a Hugging Face
    ``BatchEncoding``'s encodings); another mapping is rebuilt from its items, else made a dict;
    a dataclass is copied (nothing of the user's runs again) with the tensors in its fields and
    attributes replaced (``init=False`` fields and values ``__post_init__`` derived too).
    Anything else goes through ``other`` (if given) or is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is dict:  # the usual batch
        return {k: map_tensors(v, fn, other) for k, v in obj.items()}
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn, other) for k, v in obj.items()}
        if isinstance(obj, (dict, UserDict)):  # a copy of these holds its own items (another
            try:  # mapping's shallow copy may share its storage with the user's object)
                new = copy.copy(obj)
                for k, v in items.items():
                    new[k] = v
                return new
            except Exception:  # a mapping that does not copy: rebuilt below
                pass
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except Exception:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn, other) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, other) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)  # no constructor or __post_init__ runs again
        fields = [f.name for f in dataclasses.fields(obj)]
        for name in fields:  # init=False ones too
            if hasattr(obj, name):  # an init=False field without a default may be unset
                object.__setattr__(out, name, map_tensors(getattr(obj, name), fn, other))  # frozen ones too
        for name, value in getattr(obj, "__dict__", {}).items():  # tensors set outside the fields
            if name not in fields and isinstance(value, torch.Tensor):  # (by __post_init__, say)
                object.__setattr__(out, name, fn(value))
        return out
    return other(obj) if other is not None else obj

"""The run's configuration in the forms trackers accept: flat names, plain values.

TensorBoard's hparams plugin takes bool, number or string values; MLflow takes strings (params
are text); W&B takes any JSON. Nested dicts become dotted names (``a.b``) for the first two, and
lists, None and other values their JSON text (or ``repr`` where JSON has no form), so every
value the config holds is recorded, none dropped.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lightlike.config import plain_value


def as_json(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` as JSON values (W&B's config): paths as text, enums by value, tuples and sets as
    lists; a value JSON has no form for as its ``repr``."""

    def leaf(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
            return v
        return repr(v)  # a float NaN/inf, a class, an object: JSON cannot hold it

    return {str(k): plain_value(v, leaf=leaf, key=str) for k, v in params.items()}


def flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """``params`` flattened: ``{"a": {"b": 1}}`` as ``{"a.b": 1}``; bool, int, float and str kept,
    anything else (None, lists, an empty dict, which has no name to flatten into) as its JSON text."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in as_json(params).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, prefix=name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


def result_numbers(result: Any) -> dict[str, float]:
    """The numbers of a ``FitResult`` as ``result/<field>`` (``result/<key>`` for each of its
    metrics, ``result/val/loss``): what the trackers record at the end of a fit. None and what
    is not a number (the state, the best checkpoint's path) are left out."""
    out: dict[str, float] = {}
    for name, value in vars(result).items():
        if isinstance(value, dict):
            out.update({f"result/{k}": float(v) for k, v in value.items() if _is_number(v)})
        elif _is_number(value):
            out[f"result/{name}"] = float(value)
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


__all__ = ["as_json", "flat_params", "result_numbers"]

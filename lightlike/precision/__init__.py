"""Precision plugins, by registered name or instance."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from lightlike.errors import ConfigError
from lightlike.precision.base import Precision
from lightlike.precision.half import HalfPrecision
from lightlike.precision.mixed import MixedPrecision

PRECISIONS: dict[str, Callable[[], Precision]] = {
    "32-true": Precision,
    "bf16-mixed": lambda: MixedPrecision("bf16"),
    "16-mixed": lambda: MixedPrecision("16"),
    "bf16-true": lambda: HalfPrecision("bf16"),
    "16-true": lambda: HalfPrecision("16"),
}
ALIASES = {"32": "32-true", "fp32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "fp16": "16-mixed"}


def get_precision(spec: str | Precision) -> Precision:
    """A ``Precision`` from a registered name (``'auto'`` means ``'32-true'``) or an instance."""
    if isinstance(spec, Precision):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"precision must be a name or a Precision instance, got {type(spec).__name__}")
    name = "32-true" if spec == "auto" else ALIASES.get(spec, spec)
    if name not in PRECISIONS:
        close = difflib.get_close_matches(spec, list(PRECISIONS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown precision {spec!r}{hint}; valid names: {', '.join(['auto', *PRECISIONS])}"
        )
    return PRECISIONS[name]()


__all__ = ["PRECISIONS", "HalfPrecision", "MixedPrecision", "Precision", "get_precision"]

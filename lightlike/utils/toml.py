"""Reading TOML on every Python lightlike supports: the standard library's ``tomllib`` from
Python 3.11, its backport ``tomli`` (the same API; a dependency on 3.10 only) before."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

#: ``loads(text) -> dict``: the parsed document; ``TOMLDecodeError`` names the line on bad input.
loads = tomllib.loads
TOMLDecodeError = tomllib.TOMLDecodeError

__all__ = ["TOMLDecodeError", "loads"]

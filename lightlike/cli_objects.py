"""Callbacks and loggers the ``lightlike`` command line builds from a config file or a flag, as
LightningCLI's ``class_path``/``init_args`` do::

    callbacks:
      - class_path: lightlike.callbacks.EarlyStopping
        init_args: {monitor: val/loss, patience: 3}
      - my_pkg.callbacks.PrintLoss            # a class path alone: no arguments
    loggers:
      - csv                                   # a built-in logger, by name
      - class_path: my_pkg.loggers.MyLogger
        init_args: {project: demo}

A class path is ``package.module.ClassName``, ``package.module:ClassName`` or
``path/to/file.py:ClassName``; the class must extend ``lightlike.Callback`` (callbacks) or
``lightlike.loggers.Logger`` (loggers). A logger entry without a ``.`` or ``:`` is a built-in
logger's name. Every entry is checked (the class imported, ``init_args`` bound to its
constructor's signature) before anything is built: a bad one is one error naming the key.
Each process of a multi-process run builds its own objects; the loggers log on the main one.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from lightlike.callbacks.base import Callback
from lightlike.cli_args import nearest
from lightlike.cli_targets import load_class_path
from lightlike.errors import ConfigError, LightlikeError
from lightlike.loggers.base import Logger

#: The keys of an entry given as a table (LightningCLI's names).
ENTRY_KEYS = ("class_path", "init_args")
#: What each list holds: the base class its classes extend.
BASES: dict[str, type] = {"callbacks": Callback, "loggers": Logger}


def parse_list(raw: str, source: str) -> Any:
    """``--callbacks`` / ``--loggers`` text: JSON (``[{"class_path": ...}]``) or class paths and
    names separated by commas (``my_pkg.A,my_pkg.B``)."""
    if raw.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{source}: not valid JSON ({e}): {raw!r}") from None
    return [part.strip() for part in raw.split(",") if part.strip()]


def collect(given: dict[str, Any], file_callbacks: Any, values: dict[str, Any]) -> dict[str, tuple[list[Any], str]]:
    """The command line's callbacks and class-path loggers, checked: key -> (entries, source).
    ``given``: the parsed flags (``--callbacks`` wins over the file's ``callbacks``);
    ``values``: the settings, whose ``loggers`` get the checked entries (class paths as tables)."""
    out: dict[str, tuple[list[Any], str]] = {}
    config_file = str(given.get("cli_config"))
    callbacks, source = given.get("cli_callbacks"), "--callbacks"
    if callbacks is None:
        callbacks, source = file_callbacks, config_file
    if callbacks is not None:
        out["callbacks"] = (check_entries("callbacks", callbacks, source), source)
    loggers = values.get("loggers")
    if isinstance(loggers, dict) or (isinstance(loggers, str) and is_class_entry(loggers)) or (
            isinstance(loggers, (list, tuple)) and any(is_class_entry(x) for x in loggers)):
        source = "--loggers" if "loggers" in given else config_file
        values["loggers"] = check_entries("loggers", loggers, source)
        out["loggers"] = (values["loggers"], source)
    return out


def is_class_entry(item: Any) -> bool:
    """Whether a ``loggers`` entry names a class (a table, or a text with ``.`` or ``:``), not a
    built-in logger's name."""
    return isinstance(item, dict) or (isinstance(item, str) and ("." in item or ":" in item))


def check_entries(key: str, value: Any, source: str) -> list[Any]:
    """``value`` (a ``callbacks`` or ``loggers`` list) with every class entry in the form
    ``{"class_path": ..., "init_args": {...}}``, its class imported and its arguments bound to the
    constructor (nothing is built). ``source``: the file or flag it came from, for the errors."""
    if isinstance(value, str):
        value = parse_list(value, source)
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{source}: {key} must be a list of class paths or {{class_path, init_args}} tables, "
                          f"got {value!r}")
    out = []
    for i, item in enumerate(value):
        where = f"{source}: {key}[{i}]"
        if key == "loggers" and not is_class_entry(item):
            out.append(item)  # a built-in logger's name: build_loggers checks it
            continue
        entry = _entry(item, where)
        _bound(_class(entry, where, key), entry["init_args"], where)
        out.append(entry)
    return out


def build(key: str, entries: list[Any], source: str) -> list[Any]:
    """The objects ``check_entries``'s entries describe (a built-in logger's name stays a name)."""
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            out.append(entry)
            continue
        where = f"{source}: {key}[{i}]"
        cls = _class(entry, where, key)
        try:
            out.append(cls(**entry["init_args"]))
        except LightlikeError as e:  # the class's own check of its arguments (EarlyStopping(mode='up'))
            raise ConfigError(f"{where}.init_args: {e}") from None
    return out


def _entry(item: Any, where: str) -> dict[str, Any]:
    if isinstance(item, str):
        return {"class_path": item, "init_args": {}}
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a class path or a {{class_path, init_args}} table, got {item!r}")
    unknown = [k for k in item if k not in ENTRY_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}{nearest(str(unknown[0]), list(ENTRY_KEYS))}; "
                          "an entry is {class_path: package.module.ClassName, init_args: {...}}")
    if "class_path" not in item:
        raise ConfigError(f"{where}: no class_path (e.g. class_path: lightlike.callbacks.EarlyStopping)")
    args = item.get("init_args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}.init_args must be a table of the constructor's arguments, got {args!r}")
    return {"class_path": item["class_path"], "init_args": dict(args)}


def _class(entry: dict[str, Any], where: str, key: str) -> type:
    return load_class_path(entry["class_path"], f"{where}.class_path", BASES[key])


def _bound(cls: type, args: dict[str, Any], where: str) -> None:
    """A ``ConfigError`` naming the argument, where ``cls(**args)`` would not bind."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**args)
    except TypeError as e:
        params = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes = f"; it takes: {', '.join(params) or 'nothing'}"
        unknown = [k for k in args if k not in sig.parameters]
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            raise ConfigError(f"{where}.init_args: {cls.__name__} has no argument {unknown[0]!r}"
                              f"{nearest(unknown[0], params)}{takes}") from None
        raise ConfigError(f"{where}.init_args: {cls.__name__}: {e}{takes}") from None

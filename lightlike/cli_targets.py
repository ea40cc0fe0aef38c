"""The user's code the ``lightlike`` command line names: ``path/to/file.py:Name`` or
``package.module:Name`` (a TaskModule class, a data function), imported as ``python file.py``
or ``python -m`` would, and called with the arguments it asks for."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from lightlike.cli_args import nearest
from lightlike.errors import ConfigError, LightlikeError


class UserCodeFailed(Exception):
    """The user's code named on the command line raised while it was imported or constructed:
    ``error`` is what it raised, ``note`` one line saying which target failed how."""

    def __init__(self, error: BaseException, note: str):
        super().__init__(note)
        self.error, self.note = error, note

    def user_traceback(self) -> str:
        """``error``'s traceback without the frames of lightlike and importlib above the user's code."""
        tb = self.error.__traceback__
        while tb is not None and _not_users(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        return "".join(traceback.format_exception(type(self.error), self.error, tb))


_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
_IMPORTLIB = str(Path(importlib.__file__).resolve().parent) + os.sep  # type: ignore[arg-type]


def _not_users(filename: str) -> bool:
    return filename.startswith(("<frozen importlib", _PACKAGE, _IMPORTLIB))


def construct(cls: type, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)``; what its constructor raises (but a ``LightlikeError``) comes as
    ``UserCodeFailed`` naming it."""
    try:
        return cls(**kwargs)
    except LightlikeError:  # lightlike's own word on what to change: one line, as everywhere
        raise
    except Exception as e:
        where = getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__
        raise UserCodeFailed(e, f"{cls.__qualname__}(...) (from {where}) raised {type(e).__name__} while it was "
                                "constructed: its traceback is above") from e


def load_target(spec: str, what: str, want: type | None = None, shown: str | None = None) -> Any:
    """The object ``spec`` names. Without ``:Name``, the one subclass of ``want`` defined in it.
    ``shown``: how errors name the spec (the user's own spelling, where ``spec`` was rewritten)."""
    where, sep, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if len(where) == 1 and sep and os.sep == "\\":  # a Windows drive letter, not a separator
        where, name = spec, ""
    spec = shown or spec
    module = _import(where, what, spec)
    if not name:
        found = [v for v in vars(module).values() if isinstance(v, type) and want is not None
                 and issubclass(v, want) and v is not want and v.__module__ == module.__name__]
        if len(found) != 1:
            names = ", ".join(sorted(c.__name__ for c in found)) or "none"
            raise ConfigError(f"{what} {spec!r}: name one as {where}:NAME (defined there: {names})")
        return found[0]
    obj = getattr(module, name, None)
    if obj is None:
        pool = [k for k, v in vars(module).items() if not k.startswith("_")
                and (want is None or (isinstance(v, type) and issubclass(v, want)) or callable(v))]
        raise ConfigError(f"{what} {spec!r}: {where} has no {name!r}{nearest(name, pool)}")
    if want is not None and not (isinstance(obj, type) and issubclass(obj, want)):
        raise ConfigError(f"{what} {spec!r}: {name} is not a {want.__module__.split('.')[0]}.{want.__name__} subclass")
    if want is None and not callable(obj):
        raise ConfigError(f"{what} {spec!r}: {name} is not callable")
    return obj


def load_class_path(path: str, what: str, want: type) -> type:
    """The subclass of ``want`` a ``class_path`` names: ``package.module.ClassName`` (as
    LightningCLI writes it), ``package.module:ClassName`` or ``path/to/file.py:ClassName``."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{what}: expected a class path such as package.module.ClassName, got {path!r}")
    if ":" in path or path.endswith(".py") or "/" in path:
        return load_target(path, what, want)
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"{what} {path!r}: give the module too: package.module.ClassName "
                          "(or path/to/file.py:ClassName)")
    return load_target(f"{module}:{name}", what, want, shown=path)


def _import(where: str, what: str, spec: str) -> types.ModuleType:
    if where.endswith(".py") or "/" in where or os.sep in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise ConfigError(f"{what} {spec!r}: no such file {where!r}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # as `python file.py` would: sibling imports work
        found = importlib.util.find_spec(path.stem) if path.stem.isidentifier() else None
        if found is not None and found.origin and Path(found.origin).resolve() == path:
            # importable by its own name: classes defined there pickle (DataLoader workers that spawn)
            return _imported(path.stem, what, spec)
        name = f"_lightlike_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[name]
            if isinstance(e, Exception):
                raise _import_failed(e, what, spec) from e
            raise
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is not None and where.startswith(e.name) and where[len(e.name):][:1] in ("", "."):
            raise ConfigError(f"{what} {spec!r}: no module {e.name!r} (give a file path, e.g. "
                              "examples/cli_module.py:Classifier, or a dotted module importable from here)") from None
        raise _import_failed(e, what, spec) from e
    except Exception as e:
        raise _import_failed(e, what, spec) from e


def _imported(name: str, what: str, spec: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise _import_failed(e, what, spec) from e


def _import_failed(error: Exception, what: str, spec: str) -> Exception:
    if isinstance(error, LightlikeError):
        return error
    return UserCodeFailed(error, f"{what} {spec!r} failed to import ({type(error).__name__}): its traceback is above")


def call_with_known(fn: Any, available: dict[str, Any]) -> Any:
    """``fn(**subset)``: pass those of ``available`` (e.g. ``config``, ``module``) it names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn()
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**available)
    return fn(**{k: v for k, v in available.items() if k in params})

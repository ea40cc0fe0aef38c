"""What the ``lightlike`` command line generates: flags and config files (targets: ``cli_targets.py``).

Nothing here is written per setting. ``FitConfig``'s fields become ``--FIELD`` flags (type from
the annotation, help from the field's ``metadata["help"]``); the TaskModule's constructor
signature becomes ``--model.NAME`` flags; a config file (TOML, YAML or JSON) holds the same keys,
with the constructor's arguments in a ``model`` table. An unknown flag or key is an error naming
the nearest valid one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import inspect
import json
import os
import re
import types
import typing
from collections import abc
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from lightlike.config import FitConfig, other_name_hint, plain_value, toml_value
from lightlike.errors import ConfigError

REQUIRED = inspect.Parameter.empty
MODEL = "model"  # the config-file table / flag prefix of the module's constructor arguments
TRUE = ("true", "yes", "on", "1")
FALSE = ("false", "no", "off", "0")
NONE = ("none", "null")


# -- options: one per FitConfig field or constructor argument ---------------------------------
@dataclass
class Option:
    """One setting: its key (``max_steps`` or ``model.width``), the kinds of value it takes
    (``int``, ``float``, ``bool``, ``str``, ``list``, ``dict``, ``none``, ``any``), its default
    (``REQUIRED`` when the constructor argument has none) and its help text."""

    key: str
    kinds: frozenset[str]
    default: Any
    help: str = ""
    choices: tuple[Any, ...] | None = None  # a ``Literal[...]`` annotation's values
    #: a ``Path`` or ``Enum`` annotation's class: a value read as text (or as the enum's value, or
    #: its member's name) is given to the constructor as one, as the signature's default is
    cast: type | None = None

    def check_choice(self, value: Any) -> Any:
        """``value``, or ``ArgumentTypeError`` when a ``Literal`` annotation does not list it."""
        if self.choices is None or value in self.choices or (value is None and ("none" in self.kinds
                                                                                 or self.default is None)):
            return value
        valid = ", ".join(repr(c) for c in self.choices)
        near = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise argparse.ArgumentTypeError(f"expected one of {valid}, got {value!r}{hint}")

    @property
    def flag(self) -> str:
        return "--" + self.key

    @property
    def is_bool(self) -> bool:
        return "bool" in self.kinds

    def takes_next(self, token: str) -> bool:
        """Whether the token after this bool option given without ``=`` is its value: a true/false
        word, or (for ``bool | str``, ``bool | int``, ``Literal[True, "longest"]``) a value of its
        other kinds; never another flag or the module target (``path.py:Name``)."""
        low = token.strip().lower()
        if low in TRUE + FALSE + NONE:
            return True
        if token.startswith("-") and not _is_number(token):
            return False
        if self.choices is not None:
            return token in {str(c) for c in self.choices}
        others = self.kinds - {"bool", "none"}
        if others & {"str", "any", "list", "dict"}:
            return re.fullmatch(r".+\.py:[\w.]+", token) is None
        return bool(others & {"int", "float"}) and _is_number(token)

    def metavar(self) -> str:
        if {"int", "float"} <= self.kinds and "bool" not in self.kinds:  # max_epochs: 2 or 2.5
            return "NUMBER"
        for kind, name in (("bool", "BOOL"), ("int", "INT"), ("float", "FLOAT"), ("list", "LIST"),
                           ("dict", "JSON"), ("str", "STR")):
            if kind in self.kinds:
                return name
        return "VALUE"

    def type_name(self) -> str:
        names: list[str] = [k for k in ("bool", "int", "float", "str", "list", "dict", "any") if k in self.kinds]
        if "none" in self.kinds:
            names.append("None")
        return " | ".join(names) or "any"

    def describe(self) -> str:
        """Help text plus the default, as ``--help`` shows it."""
        default = "required" if self.default is REQUIRED else f"default: {self.default!r}"
        text = f"{self.help} " if self.help else ""
        return f"{text}({default})"

    def convert(self, raw: str) -> Any:
        """A command-line string as this option's value, or ``ArgumentTypeError``."""
        return self.to_cast(self.check_choice(convert(raw, self.kinds, self.default)))

    def to_cast(self, value: Any, strict: bool = True) -> Any:
        """``value`` as the annotation's ``Path`` or ``Enum`` class (``cast``), where it has one:
        a path from its text, an enum member from its value or name. A value that is none of the
        class's is an ``ArgumentTypeError`` (``strict``) or left as it is."""
        t = self.cast
        if t is None or value is None or isinstance(value, t):
            return value
        if issubclass(t, enum.Enum):
            try:
                return t(value)
            except (ValueError, TypeError):
                if isinstance(value, str) and value in t.__members__:
                    return t[value]
            if not strict:
                return value
            valid = ", ".join(repr(m.value) for m in t)
            raise argparse.ArgumentTypeError(f"expected one of {valid} ({t.__name__}), got {value!r}")
        if isinstance(value, (str, os.PathLike)):
            return t(value)  # type: ignore[call-arg]  # a PurePath class
        return value

    def coerce(self, value: Any, source: str | None = None) -> Any:
        """A config-file value: strings are converted as flags are where the option takes no
        strings (YAML reads ``1e-3`` as a string). With ``source`` (the file's name, for the
        module's constructor arguments, which no ``FitConfig`` validation sees) a value this option
        does not take is a ``ConfigError`` naming the file and key, as the flag's is; without it the
        value is kept as it is, for ``FitConfig``'s validation to name."""
        if isinstance(value, str) and not self.kinds & {"str", "any"}:
            try:
                return self.convert(value)
            except argparse.ArgumentTypeError as e:
                if source is None:
                    return value  # FitConfig's validation names the setting
                raise ConfigError(f"{source}: {self.key}: {e}") from None
        if source is None:
            return self.to_cast(value, strict=False)
        if not self.takes(value):
            want = " or ".join(sorted(self.kinds))
            hint = ""
            if isinstance(value, float) and "int" in self.kinds and value.is_integer():
                hint = f"; write {int(value)}"  # 64.0 is refused, as --model.width 64.0 is
            elif not isinstance(value, str) and "str" in self.kinds:
                hint = f"; write it as a string: {json.dumps(str(value))}"
            raise ConfigError(f"{source}: {self.key}: expected {want}, got {value!r} ({type(value).__name__}){hint}")
        try:
            self.check_choice(value)
            return self.to_cast(value)
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{source}: {self.key}: {e}") from None

    def takes(self, value: Any) -> bool:
        """Whether a value read from a config file is of a kind this option takes (``int`` for
        ``float`` too, ``None`` also where the default is None; never a bool for a number)."""
        k = self.kinds
        if "any" in k:
            return True
        if value is None:
            return "none" in k or self.default is None
        if isinstance(value, bool):
            return "bool" in k
        if isinstance(value, int):
            return bool(k & {"int", "float"})
        if isinstance(value, float):
            return "float" in k
        if isinstance(value, str):
            return "str" in k
        if isinstance(value, (list, tuple)):
            return "list" in k
        if isinstance(value, dict):
            return "dict" in k
        return False


def kinds_of(annotation: Any, default: Any = REQUIRED) -> frozenset[str]:
    """The kinds of value an annotation (a type, or a string under ``from __future__ import
    annotations``) admits; without one, the default's type decides."""
    if annotation is REQUIRED or annotation is None:
        if default is REQUIRED or default is None:
            return frozenset({"any", "none"} if default is None else {"any"})
        return _kind_of_value(default)
    if isinstance(annotation, str):
        out: set[str] = {"none"} if "Optional[" in annotation else set()
        for part in annotation.replace("Optional[", "").replace("]", "|").split("|"):
            name = part.strip().split("[")[0].rsplit(".", 1)[-1].lower()
            if name:
                out.add({"nonetype": "none", "sequence": "list", "tuple": "list", "mapping": "dict",
                         "path": "str"}.get(name, name if name in _SIMPLE else "any"))
        return frozenset(out or {"any"})
    if annotation is type(None):
        return frozenset({"none"})
    origin = typing.get_origin(annotation)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        return frozenset().union(*(kinds_of(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return frozenset().union(*(_kind_of_value(a) for a in typing.get_args(annotation)))
    base = origin or annotation
    for kind, types_ in (("bool", (bool,)), ("int", (int,)), ("float", (float,)), ("str", (str, os.PathLike)),
                         ("any", (bytes, bytearray)),  # Sequences, but not lists on a command line
                         ("list", (list, tuple, set, abc.Sequence, abc.Set)), ("dict", (abc.Mapping,))):
        if isinstance(base, type) and issubclass(base, types_):
            return frozenset({kind})
    return frozenset({"any"})


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` annotation (or an Optional/Union of Literals) allows; None
    where it allows any value of its kinds (or is an unresolved string)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return typing.get_args(annotation)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            if arg is type(None):
                continue
            sub = literal_choices(arg)
            if sub is None:
                return None
            out.extend(sub)
        return tuple(out) or None
    return None


_SIMPLE = {"bool", "int", "float", "str", "list", "dict", "none", "any"}


def _kind_of_value(v: Any) -> frozenset[str]:
    for kind, types_ in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", (list, tuple)),
                         ("dict", dict)):
        if isinstance(v, types_):
            return frozenset({kind})
    return frozenset({"none"}) if v is None else frozenset({"any"})


def convert(raw: str, kinds: frozenset[str], default: Any = REQUIRED) -> Any:
    """Parse a command-line string for an option taking ``kinds``."""
    low = raw.strip().lower()
    if "none" in kinds and low in NONE:
        return None
    if "bool" in kinds and low in TRUE + FALSE:
        return low in TRUE
    if "int" in kinds:
        try:
            return int(raw)
        except ValueError:
            pass
    if "float" in kinds:
        try:
            return float(raw)
        except ValueError:
            pass
    if kinds & {"list", "dict", "any"} and raw.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {raw!r}") from None
    if "list" in kinds and "str" not in kinds:
        return [_scalar(part.strip()) for part in raw.split(",") if part.strip()]  # "SIGTERM,SIGUSR1"
    if "any" in kinds and not isinstance(default, str):
        return _scalar(raw)  # 64, 0.5, true: a number or a flag where nothing says otherwise
    if kinds & {"str", "any"}:
        return raw
    want = " or ".join(sorted(kinds))
    raise argparse.ArgumentTypeError(f"expected {want}, got {raw!r}")


def _scalar(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def fit_options() -> list[Option]:
    """One option per ``FitConfig`` field, generated from the dataclass."""
    out = []
    for f in dataclasses.fields(FitConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]
        out.append(Option(f.name, kinds_of(f.type, default), default, f.metadata.get("help", "")))
    return out


def model_options(cls: type) -> tuple[list[Option], bool]:
    """One ``model.NAME`` option per constructor argument of ``cls``, and whether it also takes
    ``**kwargs`` (then any ``model.NAME`` is accepted)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return [], True
    init: Any = cls.__init__  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # unresolvable string annotations: read them as strings
        hints = {}
    doc = _param_docs(inspect.getdoc(init) or "") | _param_docs(inspect.getdoc(cls) or "")
    out, var_kw = [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
            continue
        if p.kind is p.VAR_POSITIONAL:
            continue
        ann = hints.get(p.name, p.annotation)
        out.append(Option(f"{MODEL}.{p.name}", kinds_of(ann, p.default), p.default,
                          doc.get(p.name, f"{cls.__name__}(..., {p.name}=...)"), literal_choices(ann),
                          cast_class(ann)))
    return out, var_kw


def cast_class(annotation: Any) -> type | None:
    """The ``Path`` (any ``PurePath``) or ``Enum`` class an annotation (or its ``Optional``)
    names, whose values are read as text (or as the enum's value); None for any other."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return cast_class(args[0]) if len(args) == 1 else None
    if isinstance(annotation, type) and issubclass(annotation, (PurePath, enum.Enum)):
        return annotation
    return None


def _param_docs(doc: str) -> dict[str, str]:
    """``name: text`` lines of a docstring's Args/Parameters section (Google style), if any."""
    out: dict[str, str] = {}
    for line in doc.splitlines():
        s = line.strip()
        name, sep, text = s.partition(":")
        name = name.split("(")[0].strip()
        if sep and name.isidentifier() and text.strip() and line.startswith((" ", "\t")):
            out.setdefault(name, text.strip())
    return out


def generic_option(key: str) -> Option:
    return Option(key, frozenset({"any"}), REQUIRED, "")


# -- argv ------------------------------------------------------------------------------------
def normalise_argv(argv: list[str], options: dict[str, Option], optional_value: dict[str, Any]) -> list[str]:
    """``--max-steps`` → ``--max_steps``; a bool flag given bare (``--compile``) → ``--compile=true``;
    an option in ``optional_value`` (name → predicate on the next token) given bare → ``=true``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            out.extend(argv[i:])
            break
        if tok.startswith("--") and len(tok) > 2:
            key, eq, value = tok[2:].partition("=")
            key = key.replace("-", "_")
            tok = f"--{key}{eq}{value}"
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            opt = options.get(key)
            takes = optional_value.get(key) or (opt.takes_next if opt is not None and opt.is_bool else None)
            if not eq and nxt is not None and nxt.startswith("-") and _is_number(nxt):
                # argparse takes only -1 and -.5 for negative numbers, not -1e-3, -inf or -nan:
                # --scale -1e-3 is --scale=-1e-3, as the docs promise
                out.append(f"{tok}={nxt}")
                i += 2
                continue
            if not eq and takes is not None and (nxt is None or nxt.startswith("-") or not takes(nxt)):
                tok += "=true"
        out.append(tok)
        i += 1
    return out


def nearest(name: str, valid: list[str], shown: dict[str, str] | None = None) -> str:
    """The hint for an unknown flag or key: the field an HF Trainer / Lightning name maps to
    (``config.OTHER_NAMES``), else the closest valid name (named as ``shown`` says, where it
    names it: a constructor argument ``width`` as ``model.width``)."""
    # --fp16 -> --precision 16-mixed, --resume_from_checkpoint -> --resume
    other = other_name_hint(name.lstrip("-"), flag=name.startswith("--"))
    if other is not None:
        return f" ({other})"
    # compared without the '--' every flag shares (it made --devices look like --metric_for_best)
    bare = {v.lstrip("-"): v for v in valid}
    close = difflib.get_close_matches(name.lstrip("-"), list(bare), n=1, cutoff=0.5)
    if not close:
        return ""
    return f" (did you mean {(shown or {}).get(close[0], bare[close[0]])!r}?)"


def check_flags(extras: list[str], valid_flags: list[str], prog: str) -> None:
    """Arguments argparse did not know: one error naming each bad flag and its nearest valid one."""
    bad = []
    for tok in extras:
        if tok == "--":
            continue
        if tok.startswith("-") and not _is_number(tok):
            flag = tok.split("=", 1)[0]
            bad.append(f"{flag}{nearest(flag, valid_flags)}")
        elif not bad:
            raise ConfigError(f"unexpected argument {tok!r} (see {prog} --help)")
    if bad:
        raise ConfigError(f"unknown flag{'s' if len(bad) > 1 else ''} {'; '.join(bad)} (see {prog} --help)")


def _is_number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False


# -- config files ----------------------------------------------------------------------------
def read_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML (``.toml``), YAML (``.yaml``/``.yml``, needs PyYAML) or JSON (``.json``) file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    text = p.read_text()
    try:
        if suffix == ".toml":
            from lightlike.utils import toml

            data = toml.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = _yaml().safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {str(p)!r}: unknown format; use .toml, .yaml/.yml or .json")
    except ConfigError:
        raise
    except Exception as e:  # the parser's own message names the line
        detail = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # YAML's span lines
        raise ConfigError(f"config file {str(p)!r} does not parse: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table of settings, not {type(data).__name__}")
    return data


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError("YAML config files need PyYAML: pip install pyyaml "
                          "(or use a .toml or .json file)") from None
    return yaml


def split_config(data: dict[str, Any], source: str, fit_opts: dict[str, Option],
                 model_opts: dict[str, Option] | None, var_kw: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config file's settings as (FitConfig values, constructor arguments), every key checked.
    ``model_opts=None``: no module named, so a ``model`` table is accepted unchecked."""
    fit: dict[str, Any] = {}
    model: dict[str, Any] = {}
    for key, value in data.items():
        if key == MODEL:
            if value is None:  # YAML's bare "model:": an empty table
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{MODEL}' must be a table of constructor arguments, got {value!r}")
            for name, v in value.items():
                full = f"{MODEL}.{name}"
                if model_opts is not None and full not in model_opts and not var_kw:
                    hint = (f" ({name!r} is a run setting: put it at the top level of the file, outside the "
                            f"'{MODEL}' table)") if name in fit_opts else nearest(full, list(model_opts))
                    raise ConfigError(f"{source}: unknown key {full!r}{hint}; "
                                      f"the module takes: {', '.join(o.split('.', 1)[1] for o in model_opts) or 'nothing'}")
                opt = (model_opts or {}).get(full)
                model[name] = opt.coerce(v, source) if opt else v
        elif key in fit_opts:
            fit[key] = fit_opts[key].coerce(value)
        elif model_opts is not None and f"{MODEL}.{key}" in model_opts:
            raise ConfigError(f"{source}: unknown key {key!r} (a constructor argument of the module: put it in "
                              f"the '{MODEL}' table, [{MODEL}] in TOML)")
        else:
            # a misspelt constructor argument is compared by its own name (widht ~ width), and
            # named as the model table's key
            args = {o.split(".", 1)[1]: o for o in (model_opts or {})}
            args = {k: v for k, v in args.items() if k not in fit_opts and k != MODEL}
            hint = nearest(key, [*fit_opts, MODEL, *args], shown=args)
            if hint in {f" (did you mean {full!r}?)" for full in args.values()}:
                hint = f"{hint[:-1]} constructor arguments go in the '{MODEL}' table)"
            raise ConfigError(f"{source}: unknown key {key!r}{hint}")
    return fit, model


def dump_config(fit: dict[str, Any], model: dict[str, Any] | None, fmt: str,
                helps: dict[str, str] | None = None, defaults: dict[str, Any] | None = None) -> str:
    """The resolved settings as TOML, YAML or JSON that ``--config`` reads back; ``helps``
    (key → text) adds each field's help as a comment (TOML, YAML)."""
    if fmt == "json":
        doc = plain_value({**fit, **({MODEL: model} if model is not None else {})})
        return json.dumps(doc, indent=2, default=str) + "\n"
    lines: list[str] = []
    sections: list[tuple[str | None, dict[str, Any]]] = [(None, fit)]
    if model is not None:
        sections.append((MODEL, model))
    for table, values in sections:
        if table is not None:
            lines.append("")
            # YAML reads a bare "model:" as null: an empty table is written as one
            lines.append(f"[{table}]" if fmt == "toml" else f"{table}:" if values else f"{table}: {{}}")
        indent = "  " if (table is not None and fmt == "yaml") else ""
        for key, v in values.items():
            v = plain_value(v)
            if helps and helps.get(key if table is None else f"{table}.{key}"):
                lines.append(f"{indent}# {helps[key if table is None else f'{table}.{key}']}")
            if fmt == "toml":
                full = key if table is None else f"{table}.{key}"
                if v is None and (defaults or {}).get(full) not in (None, REQUIRED):
                    raise ConfigError(f"{full}=None cannot be written as TOML (it has no null; reading it back "
                                      f"would give the default {defaults[full]!r}): use --format json or yaml")  # type: ignore[index]
                lines.append(f"# {key} = None (unset)" if v is None else f"{key} = {toml_value(v)}")
            else:
                yaml = _yaml()
                try:
                    dumped = yaml.safe_dump({key: v}, default_flow_style=False, sort_keys=False).rstrip("\n")
                except yaml.YAMLError:
                    raise ConfigError(f"cannot write {key}={v!r} to YAML: use --format json") from None
                lines.extend(indent + line for line in dumped.splitlines())
    return "\n".join(lines) + "\n"

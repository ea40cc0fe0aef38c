"""The ``lightlike`` command line.

    lightlike fit MODULE_PATH:ClassName [--config run.toml|.yaml|.json] [--FIELD VALUE ...]
                  [--model.ARG VALUE ...] [--data FILE.py:FUNCTION] [--resume [CHECKPOINT]]
    lightlike validate|test|predict MODULE_PATH:ClassName [--checkpoint DIR] [same options]
    lightlike config [MODULE_PATH:ClassName] [same options] [--format toml|yaml|json] [--comments]
    lightlike export CHECKPOINT_DIR OUT_DIR [--no-verify-hashes] [--merge --base BASE_DIR]

Every ``FitConfig`` field is a flag and a config-file key, and every constructor argument of the
module is a ``--model.NAME`` flag and a key of the file's ``model`` table, all generated (see
``cli_args.py``). Precedence: defaults < config file < flags. Under ``torchrun``/``srun`` the
Fitter reads the environment, so the same command runs on many processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightlike import __version__
from lightlike.checkpoint import (
    export_weights,
    is_checkpoint_dir,
    verify_checkpoint,
)
from lightlike.checkpoint.export import checkpoint_of
from lightlike.checkpoint.files import HPARAMS_FILE, WEIGHTS_FILE
from lightlike.cli_args import (
    MODEL,
    REQUIRED,
    check_flags,
    dump_config,
    fit_options,
    generic_option,
    model_options,
    nearest,
    normalise_argv,
    read_config_file,
    split_config,
)
from lightlike.cli_objects import build, collect
from lightlike.cli_targets import UserCodeFailed, call_with_known, construct, load_target
from lightlike.config import FitConfig
from lightlike.errors import CheckpointError, ConfigError, DataError, LightlikeError, OutputDirError
from lightlike.fitter import Fitter
from lightlike.module import TaskModule

COMMANDS = {
    "fit": "train a TaskModule; checkpoints and logs land in output_dir",
    "validate": "evaluate on the validation data (val_data() or --data); prints the metrics as JSON",
    "test": "evaluate on the test data (test_data(), else val_data(), or --data); prints the metrics as JSON",
    "predict": "predictions in dataset order, written to output_dir/predictions.pt; prints the metrics",
    "config": "print the full resolved config (defaults filled in) as TOML, YAML or JSON",
    "export": ("write a plain model.safetensors (+ hparams/config) from a checkpoint; a PEFT adapter's as the "
               "adapter folder PeftModel.from_pretrained loads (--merge --base BASE_DIR: the merged model)"),
}
RUNS = ("fit", "validate", "test", "predict")
EVALS = ("validate", "test", "predict")
#: Where each command's data comes from: the roles tried in order (``<role>_data()`` methods, or
#: the keys of what ``--data`` returns).
DATA_ROLES = {"validate": ("val",), "test": ("test", "val"), "predict": ("predict", "test", "val")}
TARGET_HELP = ("the TaskModule: a file path and class (examples/cli_module.py:Classifier) or a dotted "
               "module (mypackage.models:Classifier); the class may be left out when the file defines one")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (a ``ConfigError``), not usage plus message."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _esc(text: str) -> str:
    return text.replace("%", "%%")


# ==============================================================================================
# parsers, generated
# ==============================================================================================
def _cli_options(cmd: str) -> list[tuple[str, dict[str, Any]]]:
    """The command's own options (not settings): name → argparse keywords."""
    opts: list[tuple[str, dict[str, Any]]] = [
        ("config", dict(metavar="FILE", help="settings from a TOML, YAML or JSON file (flags win); the "
                        "module's constructor arguments go in its 'model' table")),
    ]
    opts.append(("callbacks", dict(metavar="LIST", help=(
        "callbacks to add: class paths (my_pkg.MyCallback,lightlike.callbacks.EarlyStopping) or JSON "
        "[{\"class_path\": ..., \"init_args\": {...}}]; replaces the config file's 'callbacks' list. "
        "Loggers take the same entries in 'loggers', beside the built-in names"))))
    if cmd in RUNS:
        opts.append(("data", dict(metavar="FILE.py:FUNCTION", help=(
            "take the data from FUNCTION instead of the module's <role>_data() methods; it returns "
            "(train, val) (or (train, val, test), or a dict with keys train/val/test/predict) of torch "
            "Datasets or DataLoaders, and may take the arguments 'config' (the FitConfig) and 'module'"))))
    if cmd == "fit":
        opts.append(("resume", dict(metavar="CHECKPOINT", type=_resume_value, help=(
            "continue from the newest valid checkpoint in output_dir (--resume), from the one named "
            "(--resume runs/x/checkpoint-200), or from the newest if there is one, else start fresh "
            "(--resume auto: for scripts that SLURM or torchrun restart)"))))
    if cmd in EVALS:
        opts.append(("checkpoint", dict(metavar="DIR", help=(
            "load weights first: a checkpoint-N directory, an output_dir (its newest valid checkpoint) or a "
            "`lightlike export` folder; its hparams.json supplies constructor arguments not given otherwise"))))
    if cmd == "predict":
        opts.append(("predictions_file", dict(metavar="FILE", help=(
            "where to write predictions, labels and metrics (default: OUTPUT_DIR/predictions.pt; "
            "a .json name writes JSON)"))))
    if cmd == "config":
        opts.append(("format", dict(choices=("toml", "yaml", "json"), default="toml", help="output format")))
        opts.append(("comments", dict(metavar="BOOL", type=lambda s: s.lower() in ("true", "1", "yes", "on"),
                                      default=False, help="write each setting's help text above it")))
    return opts


def _resume_value(raw: str) -> bool | str:
    low = raw.lower()
    if low in ("true", "yes", "on", "1"):
        return True
    if low in ("false", "no", "off", "0"):
        return False
    return "auto" if low == "auto" else raw


def _build_parser(cmd: str, fit_opts: dict, model_opts: dict, cls: type | None, add_help: bool = True) -> _Parser:
    usage = "%(prog)s " + ("[MODULE_PATH:ClassName]" if cmd == "config" else "MODULE_PATH:ClassName") + \
        " [--config FILE] [--FIELD VALUE ...] [--model.ARG VALUE ...] [options]"
    p = _Parser(prog=f"lightlike {cmd}", description=COMMANDS[cmd], add_help=add_help, allow_abbrev=False, usage=usage,
                epilog="Flags win over the config file, which wins over the defaults. A bool flag given "
                       "alone means true (--compile); '-' and '_' are the same in flag names.")
    p.add_argument("target", nargs="?", metavar="MODULE_PATH:ClassName", help=_esc(TARGET_HELP))
    for name, kw in _cli_options(cmd):
        assert name not in fit_opts, f"--{name} would hide the FitConfig field of that name"
        kw = {k: (_esc(v) if k == "help" else v) for k, v in kw.items()}
        p.add_argument(f"--{name}", dest=f"cli_{name}", **kw)
    group = p.add_argument_group("settings (FitConfig fields; also keys of the --config file)")
    for o in fit_opts.values():
        group.add_argument(o.flag, dest=o.key, type=o.convert, default=argparse.SUPPRESS, metavar=o.metavar(),
                           help=_esc(o.describe()))
    if model_opts:
        title = (f"{cls.__name__} constructor arguments (also keys of the config file's [{MODEL}] table)"
                 if cls is not None else "constructor arguments")
        group = p.add_argument_group(title)
        for o in model_opts.values():
            group.add_argument(o.flag, dest=o.key, type=o.convert, default=argparse.SUPPRESS, metavar=o.metavar(),
                               help=_esc(o.describe()))
    return p


def _top_parser() -> argparse.ArgumentParser:
    lines = ["settings (any of them is a --FLAG of fit/validate/test/predict/config and a key of a --config file):"]
    for o in fit_options():
        head = f"  {o.key} ({o.type_name()}, default {o.default!r})"
        lines.append(head)
        lines.extend(textwrap.wrap(o.help, width=100, initial_indent="      ", subsequent_indent="      "))
    lines += ["", "module constructor arguments: --model.NAME VALUE, or a [model] table in the config file",
              "(`lightlike fit MODULE:Class --help` lists them).", "",
              "examples:",
              "  lightlike fit examples/cli_module.py:Classifier --config run.toml --max_steps 500 --model.width 64",
              "  torchrun --nproc_per_node 4 $(which lightlike) fit examples/cli_module.py:Classifier --strategy ddp",
              "  lightlike validate examples/cli_module.py:Classifier --checkpoint runs/cli/checkpoint-500",
              "  lightlike config examples/cli_module.py:Classifier --config run.toml --format yaml"]
    p = argparse.ArgumentParser(prog="lightlike", description="lightlike command line",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(lines))
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


# ==============================================================================================
# resolving flags + file + defaults
# ==============================================================================================
def _parse(cmd: str, argv: list[str]) -> dict[str, Any]:
    """Parse ``argv`` in two passes (the first finds the module, whose constructor the second
    turns into flags) and resolve the settings. Returns what the command needs."""
    fit_opts = {o.key: o for o in fit_options()}
    # --resume's value: a word, or a path (an existing one, or one that names a checkpoint: a missing
    # one is then reported as missing, not as a stray argument); never the module target (path.py:Name)
    optional = {"resume": lambda t: t.lower() in ("true", "false", "yes", "no", "1", "0", "auto") or (
                    ":" not in t and (Path(t).exists() or "/" in t or t.startswith("checkpoint-"))),
                "comments": lambda t: t.lower() in ("true", "false", "yes", "no", "1", "0")}
    own = {f"--{name}" for name, _ in _cli_options(cmd)} | {"-h", "--help"}
    wants_help = any(t in ("-h", "--help") for t in (argv[: argv.index("--")] if "--" in argv else argv))

    # pass 1: where is the module? (constructor flags seen in argv are taken as values of any kind)
    argv1 = normalise_argv(argv, fit_opts, optional)
    seen = {t[2:].split("=", 1)[0] for t in argv1 if t.startswith(f"--{MODEL}.")}
    if argv1 and not argv1[0].startswith("-"):
        target: str | None = argv1[0]
    else:
        p1 = _build_parser(cmd, fit_opts, {k: generic_option(k) for k in seen}, None, add_help=False)
        ns1, extras = p1.parse_known_args(argv1)
        extras = [t for t in extras if t not in ("-h", "--help")]
        check_flags(extras, [*own, *(o.flag for o in fit_opts.values())], f"lightlike {cmd}")
        target = ns1.target
    cls = None
    if target is not None:
        try:
            cls = load_target(target, "module", TaskModule)
        except LightlikeError as e:
            if not wants_help:
                raise
            print(f"lightlike {cmd}: note: {e}", file=sys.stderr)

    # pass 2: every flag typed, the constructor's included
    model_list, var_kw = model_options(cls) if cls is not None else ([], False)
    model_opts = {o.key: o for o in model_list}
    if var_kw or cls is None:
        model_opts.update({k: generic_option(k) for k in seen if k not in model_opts})
    argv2 = normalise_argv(argv, {**fit_opts, **model_opts}, optional)
    parser = _build_parser(cmd, fit_opts, model_opts, cls)
    ns, extras = parser.parse_known_args(argv2)
    check_flags(extras, [*own, *(o.flag for o in fit_opts.values()), *(o.flag for o in model_opts.values())],
                parser.prog)
    given = vars(ns)
    if cmd != "config" and cls is None:
        raise ConfigError(f"{cmd} needs the module: lightlike {cmd} MODULE_PATH:ClassName ... "
                          "(e.g. examples/cli_module.py:Classifier)")

    # settings: defaults < config file < flags
    file_fit: dict[str, Any] = {}
    file_model: dict[str, Any] = {}
    file_callbacks = None
    if given.get("cli_config"):
        data = read_config_file(given["cli_config"])
        file_callbacks = data.pop("callbacks", None)  # not a FitConfig field: class paths (cli_objects.py)
        file_fit, file_model = split_config(data, given["cli_config"], fit_opts,
                                            model_opts if cls is not None else None, var_kw)
    values = {**file_fit, **{k: v for k, v in given.items() if k in fit_opts}}
    entries = collect(given, file_callbacks, values)  # callbacks and loggers by class path, checked
    try:
        config = FitConfig.from_dict(values)
        if cmd == "fit":  # said before the module, the data and the processes are set up
            config.need_stopping_criterion()
    except ConfigError as e:  # a value the config file set (and no flag replaced): name the file
        from_file = [k for k in e.settings if k in file_fit and k not in given]
        if not from_file:
            raise
        raise ConfigError(f"{given['cli_config']}: {e}", settings=e.settings) from None

    # constructor arguments: signature defaults < checkpoint's hparams.json < config file < flags
    checkpoint = _resolve_checkpoint(given["cli_checkpoint"], config) if given.get("cli_checkpoint") else None
    model = (_constructor_args(cls, model_list, model_opts, var_kw, checkpoint, file_model, given)
             if cls is not None or file_model else None)
    return {"config": config, "cls": cls, "model": model, "checkpoint": checkpoint, "args": given, "entries": entries,
            "fit_help": {k: o.help for k, o in fit_opts.items()},
            "model_help": {k: o.help for k, o in model_opts.items()},
            "defaults": {**{k: o.default for k, o in fit_opts.items()}, **{k: o.default for k, o in model_opts.items()}}}


def _constructor_args(cls: Any, model_list: list[Any], model_opts: dict[str, Any], var_kw: bool,
                      checkpoint: Path | None, file_model: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The module's constructor arguments: signature defaults < the checkpoint's hparams.json <
    the config file's [model] table < ``--model.*`` flags. A required one still missing is an error."""
    model = {o.key.split(".", 1)[1]: o.default for o in model_list if o.default is not REQUIRED}
    if checkpoint is not None and (checkpoint / HPARAMS_FILE).is_file():
        model.update(_saved_hparams(checkpoint / HPARAMS_FILE, model_opts, var_kw))
    model.update(file_model)
    model.update({k.split(".", 1)[1]: v for k, v in given.items() if k.startswith(f"{MODEL}.")})
    missing = [o.key.split(".", 1)[1] for o in model_list if o.key.split(".", 1)[1] not in model]
    if missing and cls is not None:
        raise ConfigError(f"{cls.__name__} needs constructor argument(s) {', '.join(missing)}: pass "
                          f"--{MODEL}.{missing[0]} VALUE or set it in the config file's [{MODEL}] table")
    return model


def _saved_hparams(path: Path, model_opts: dict[str, Any], var_kw: bool) -> dict[str, Any]:
    """A checkpoint's hparams.json as constructor arguments, each given back through its option
    as a flag's value is: JSON has no path or enum, so a ``Path`` or an ``Enum`` argument (saved
    as its text or value) is given to the constructor as one again."""
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is unreadable ({e})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} holds a JSON {type(saved).__name__}, not the constructor's arguments")
    out = {}
    for k, v in saved.items():
        opt = model_opts.get(f"{MODEL}.{k}")
        if opt is not None:
            out[k] = opt.to_cast(v, strict=False)  # a value that is none of the class's: left as saved
        elif var_kw:
            out[k] = v
    return out


def _note(line: str) -> None:
    print(f"lightlike: {line}", file=sys.stderr)


def _resolve_checkpoint(spec: str, config: Any) -> Path:
    p = Path(spec)
    if not p.is_dir():
        raise ConfigError(f"--checkpoint {spec!r}: no such directory")
    if is_checkpoint_dir(p):
        verify_checkpoint(p, hashes=config.verify_hashes)
        return p
    if (p / WEIGHTS_FILE).is_file():
        return p  # a `lightlike export` folder
    try:  # (which weights are loaded must not be a guess: the skipped newer ones are named)
        latest = checkpoint_of(p, config.verify_hashes, "--checkpoint", _note)
    except CheckpointError as e:
        raise ConfigError(f"--checkpoint {spec!r} is neither a checkpoint, an export folder, nor an "
                          f"output_dir holding a valid checkpoint ({e})") from None
    if latest == p:
        raise ConfigError(f"--checkpoint {spec!r} is neither a checkpoint, an export folder, nor an "
                          "output_dir holding a valid checkpoint")
    return latest


# ==============================================================================================
# the commands
# ==============================================================================================
def _cmd_run(cmd: str, argv: list[str]) -> int:
    r = _parse(cmd, argv)
    if cmd == "config":
        helps = None
        if r["args"]["cli_comments"]:
            helps = {**r["fit_help"], **{k: v for k, v in r["model_help"].items() if v}}
        fit = {**r["config"].to_dict(), **{k: v for k, (v, _) in r["entries"].items()}}
        sys.stdout.write(dump_config(fit, r["model"], r["args"]["cli_format"], helps, r["defaults"]))
        return 0
    config, cls, kwargs, args = r["config"], r["cls"], r["model"], r["args"]
    if cmd == "predict":  # where the predictions go is checked before anything is built or predicted
        path = Path(args.get("cli_predictions_file") or Path(config.output_dir) / "predictions.pt")
        _check_predictions_path(path, named=bool(args.get("cli_predictions_file")))
    made = {key: build(key, entries, source) for key, (entries, source) in r["entries"].items()}
    if "loggers" in made:
        config = config.replace(loggers=made["loggers"])
    fitter = Fitter(config, callbacks=made.get("callbacks"))
    if cmd == "fit":
        with fitter.init_module():  # FSDP: on the meta device; ZeRO-3: partitioned as built
            module = construct(cls, kwargs)
        _record_hparams(module, kwargs)
        train, val = _fit_data(args.get("cli_data"), module, config)
        result = fitter.fit(module, train, val, resume=args.get("cli_resume"))
        if fitter.strategy.is_global_zero:  # type: ignore[union-attr]
            _print_json({"global_step": result.global_step, "training_loss": result.training_loss,
                         "metrics": result.metrics, "best_checkpoint": result.best_checkpoint,
                         "last_checkpoint": result.last_checkpoint, "output_dir": config.output_dir})
        return 0

    module = construct(cls, kwargs)
    _record_hparams(module, kwargs)
    if r["checkpoint"] is not None:
        _load_weights(module, r["checkpoint"], config)
    data = _eval_data(cmd, args.get("cli_data"), module, config)
    if cmd == "predict":
        predicted = fitter.predict(module, data)
        if fitter.strategy.is_global_zero:  # type: ignore[union-attr]
            _write_predictions(path, predicted)
            _print_json({"metrics": predicted.metrics, "predictions_file": str(path)})
        return 0
    metrics = getattr(fitter, cmd)(module, data)
    if fitter.strategy.is_global_zero:  # type: ignore[union-attr]
        _print_json(metrics)
    return 0


def _record_hparams(module: Any, kwargs: dict[str, Any]) -> None:
    """The constructor arguments go into the checkpoint's hparams.json, unless the module
    recorded its own (``save_hyperparameters``)."""
    if isinstance(getattr(module, "hparams", None), dict) and not module.hparams:
        module.hparams.update(kwargs)


def _load_weights(module: Any, checkpoint: Path, config: Any) -> None:
    if (checkpoint / WEIGHTS_FILE).is_file():
        from safetensors import SafetensorError

        try:
            module.load_weights(checkpoint)
        except SafetensorError as e:  # a torn or foreign file: named, as a checkpoint's torn file is
            raise CheckpointError(f"--checkpoint {str(checkpoint)!r}: {checkpoint / WEIGHTS_FILE} is not a "
                                  f"readable safetensors file (cut short by an interrupted copy?): {e}") from None
        return

    with tempfile.TemporaryDirectory(prefix="lightlike-weights-") as tmp:  # sharded: consolidate first
        export_weights(checkpoint, tmp, hashes=config.verify_hashes)
        module.load_weights(tmp)


def _data_source(spec: str | None, module: Any, config: Any, primary: str) -> tuple[Any, Any]:
    """Two functions: role → data (or None), and role → the error when it is missing."""
    if spec is None:
        def from_module(role: str) -> Any:
            fn = getattr(module, f"{role}_data", None)
            return fn() if callable(fn) else None

        def no_method(role: str) -> str:
            return (f"{type(module).__name__} has no {role}_data() method: define {role}_data(self) returning a "
                    "torch Dataset or DataLoader, or pass --data FILE.py:FUNCTION")
        return from_module, no_method

    out = call_with_known(load_target(spec, "--data", None), {"config": config, "module": module})
    roles = ["train", "val", "test", "predict"]
    if isinstance(out, tuple):
        if not 1 <= len(out) <= 4:
            raise DataError(f"--data {spec}: returned a tuple of {len(out)}; return (train, val) or (train, val, test)")
        sets = dict(zip(roles, out, strict=False))
    elif isinstance(out, dict) and out and all(isinstance(k, str) for k in out) and set(out) <= set(roles):
        sets = dict(out)
    elif isinstance(out, dict) and any(k in roles for k in out):
        bad = next(k for k in out if k not in roles)
        raise DataError(f"--data {spec}: unknown key {bad!r}{nearest(str(bad), roles)}; use {', '.join(roles)}")
    else:
        sets = {primary: out}

    def not_returned(role: str) -> str:
        return (f"--data {spec} returned no {role} data: return (train, val), (train, val, test) or a dict "
                "with keys among train, val, test, predict")
    return sets.get, not_returned


def _fit_data(spec: str | None, module: Any, config: Any) -> tuple[Any, Any]:
    get, missing = _data_source(spec, module, config, "train")
    train = get("train")
    if train is None:
        raise DataError(missing("train"))
    return train, get("val")


def _eval_data(cmd: str, spec: str | None, module: Any, config: Any) -> Any:
    roles = DATA_ROLES[cmd]
    get, missing = _data_source(spec, module, config, roles[0])
    for role in roles:
        data = get(role)
        if data is not None:
            if role != roles[0] and os.environ.get("RANK", "0") == "0":
                print(f"lightlike {cmd}: note: no {roles[0]} data, using the {role} data", file=sys.stderr)
            return data
    raise DataError(missing(roles[0]))


def _check_predictions_path(path: Path, named: bool) -> None:
    """A one-line error, before anything is predicted, where the predictions cannot be written:
    a path that is a directory, or one under a file (an ``output_dir`` that is a file)."""
    what = f"--predictions_file {str(path)!r}" if named else f"the predictions file {str(path)!r}"
    if path.is_dir():
        raise ConfigError(f"{what} is a directory: name a file (e.g. {str(path / 'predictions.pt')!r})")
    for parent in path.parents:
        if parent.exists():
            if parent.is_dir():
                return
            if not named and parent == path.parent:
                raise OutputDirError(f"output_dir {str(parent)!r} is a file, not a directory: choose another "
                                     "--output_dir (predict writes OUTPUT_DIR/predictions.pt)")
            raise ConfigError(f"{what}: {str(parent)!r} is a file, not a directory")


def _write_predictions(path: Path, result: Any) -> None:
    _check_predictions_path(path, named=True)  # again: it may have changed while predicting
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # replaced whole (written aside, then renamed), and said so
        print(f"lightlike predict: replacing {path} (pass --predictions_file to keep it)", file=sys.stderr)
    payload = {"predictions": result.predictions, "labels": result.labels, "metrics": result.metrics}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix.lower() == ".json":
            tmp.write_text(json.dumps(_plain(payload)) + "\n")
        else:
            torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write or rename that failed leaves no temp file behind


def _plain(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, default=str), flush=True)


def _cmd_export(argv: list[str]) -> int:
    p = _Parser(prog="lightlike export", description=COMMANDS["export"], allow_abbrev=False)
    p.add_argument("checkpoint_dir", help="a checkpoint-N directory (sharded ones are consolidated), or a run's "
                   "output_dir (its newest valid checkpoint)")
    p.add_argument("out_dir", help="where model.safetensors (+ hparams.json, config.json) go")
    p.add_argument("--no-verify-hashes", "--no_verify_hashes", dest="no_verify_hashes", action="store_true",
                   help="check sizes only (fast, for huge models)")
    p.add_argument("--merge", action="store_true",
                   help="a PEFT adapter's checkpoint: write the merged model (needs --base) instead of the adapter")
    p.add_argument("--base", default=None, help="a PEFT adapter's checkpoint: the base model's folder "
                   "(from_pretrained), checked against the checkpoint's base fingerprint")
    args = p.parse_args(argv)

    args.checkpoint_dir = checkpoint_of(args.checkpoint_dir, not args.no_verify_hashes, say=_note)  # a run's: its newest
    hparams = Path(args.checkpoint_dir) / HPARAMS_FILE
    if hparams.is_file() and json.loads(hparams.read_text()).get("peft_config"):  # the adapter alone
        from lightlike.interop.hf import export_hf

        path = export_hf(args.checkpoint_dir, args.out_dir, hashes=not args.no_verify_hashes, base=args.base,
                         merge=args.merge)
    elif args.merge or args.base:
        raise ConfigError(f"--merge and --base are for a PEFT adapter's checkpoint; {args.checkpoint_dir} holds a "
                          "whole model (its hparams.json names no peft_config): drop them")
    else:
        path = export_weights(args.checkpoint_dir, args.out_dir, hashes=not args.no_verify_hashes)
    print(f"wrote {path}")
    return 0


def _output_dir_hint(error: OutputDirError | CheckpointError) -> str:
    """The flags for what an ``OutputDirError`` or a ``CheckpointError`` offers in Python terms:
    ``--resume auto`` for resume='auto' (a bare ``--resume`` would fail there: nothing to
    resume), ``--resume`` for resume=True."""
    flags = {"resume='auto'": "--resume auto", "resume=True": "--resume",
             "overwrite_output_dir=True": "--overwrite_output_dir"}
    named = [flags[o] for o in error.offers if o in flags] + ["another --output_dir"]
    return f" (on the command line: {', or '.join(named)})"


# ==============================================================================================
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for a user error, printed as one line)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        _top_parser().print_help(sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"lightlike {__version__}")
        return 0
    cmd = args[0]
    if cmd not in COMMANDS:
        print(f"lightlike: error: unknown command {cmd!r}{nearest(cmd, list(COMMANDS))}; "
              f"commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        if cmd == "export":
            return _cmd_export(args[1:])
        return _cmd_run(cmd, args[1:])
    except LightlikeError as e:
        hint = ""
        if isinstance(e, (OutputDirError, CheckpointError)) and e.offers:  # the settings, as flags
            hint = _output_dir_hint(e)
        print(f"lightlike {cmd}: error: {e}{hint}", file=sys.stderr)
        return 2
    except UserCodeFailed as e:  # the user's code raised: its own traceback, and which target
        sys.stderr.write(e.user_traceback())
        print(f"lightlike {cmd}: {e.note}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

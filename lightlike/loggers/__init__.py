"""Loggers: CSV/JSONL metrics files, TensorBoard, W&B, MLflow, Comet and Neptune; Python logging; the
model summary.

Importing this package imports neither tensorboard, tqdm, wandb, mlflow, comet_ml nor neptune: each
logger and the progress bar import theirs when constructed / started.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightlike.errors import ConfigError
from lightlike.loggers.base import Logger
from lightlike.loggers.comet import CometLogger
from lightlike.loggers.csv import CSVLogger, JSONLLogger
from lightlike.loggers.mlflow import MLflowLogger
from lightlike.loggers.neptune import NeptuneLogger
from lightlike.loggers.tracker import TrackerLogger
from lightlike.loggers.wandb import WandbLogger

LOGGER_NAMES = ("csv", "jsonl", "tensorboard", "wandb", "mlflow", "comet", "neptune")
#: other names a logger is known by (the HF Trainer's ``report_to`` says ``comet_ml``)
LOGGER_ALIASES = {"comet_ml": "comet"}
#: the trackers built by name, each keyed by its ``run_key``
TRACKERS = {cls.run_key: cls for cls in (WandbLogger, MLflowLogger, CometLogger, NeptuneLogger)}
#: ``logs/`` file recording each resume's step and time (``build_loggers``)
RESUMES = "resumes.jsonl"
#: The files lightlike's own loggers write in ``logs/`` (and their temp files): what
#: ``overwrite_output_dir=True`` removes there; anything else in ``logs/`` is left alone. The
#: TensorBoard logger's names carry the time in nanoseconds (20 digits; torch's and TensorFlow's
#: writers put seconds there).
OWN_LOG_FILES = re.compile(r"^(metrics\.csv|metrics\.jsonl|resumes\.jsonl)(\.tmp)?$|^events\.out\.tfevents\.\d{20}\.")
log = logging.getLogger("lightlike")


def own_log_files(log_dir: str | Path) -> list[Path]:
    """The files in ``log_dir`` named as lightlike's loggers name theirs (``OWN_LOG_FILES``); none
    when ``log_dir`` is a symbolic link (the files it leads to may be another run's)."""
    d = Path(log_dir)
    if d.is_symlink() or not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if OWN_LOG_FILES.match(p.name) and p.is_file())


def tensorboard_available() -> bool:
    """Whether the tensorboard package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):
        return False


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, LOGGER_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown logger {name!r}{hint}; valid names: {', '.join(LOGGER_NAMES)}")


def _normalise(spec: Any) -> list[str | Logger]:
    """The spec as a checked list of names and Logger instances (no logger is constructed)."""
    if spec is None:
        return []
    if isinstance(spec, Logger):
        return [spec]
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            names = ["csv"]
            if tensorboard_available():
                names.append("tensorboard")
            else:
                log.warning("tensorboard is not installed: logging to CSV only "
                            "(pip install 'lightlike[tensorboard]')")
            return list(names)
        if text in ("", "none", "null"):  # the command line's words for None
            return []
        spec = [part.strip() for part in text.split(",") if part.strip()]  # "csv,tensorboard"
    if not isinstance(spec, Iterable) or isinstance(spec, (bytes, dict)):
        raise ConfigError(f"loggers must be 'auto', a list of names ({', '.join(LOGGER_NAMES)}) and/or "
                          f"Logger instances, or []; got {spec!r}")
    out: list[str | Logger] = []
    for item in spec:
        if isinstance(item, Logger):
            out.append(item)
        elif isinstance(item, str):
            name = item.strip().lower()
            name = LOGGER_ALIASES.get(name, name)
            if name not in LOGGER_NAMES:
                raise _unknown(item)
            if name in out:
                raise ConfigError(f"logger {name!r} is listed twice; each file would get every row twice")
            out.append(name)
        else:
            raise ConfigError(f"loggers entries must be names ({', '.join(LOGGER_NAMES)}) or Logger "
                              f"instances, got {type(item).__name__}")
    return out


def _by_name(name: str, log_dir: Path) -> Logger:
    if name == "csv":
        return CSVLogger(log_dir)
    if name == "jsonl":
        return JSONLLogger(log_dir)
    if name in TRACKERS:
        return TRACKERS[name]()
    from lightlike.loggers.tensorboard import TensorBoardLogger

    return TensorBoardLogger(log_dir)


def build_loggers(spec: Any, output_dir: str | Path, enabled: bool = True, *, resume_step: int | None = None,
                  hyperparams: dict[str, Any] | None = None, runs: dict[str, str] | None = None) -> list[Logger]:
    """The loggers of a run, writing under ``output_dir/logs/``.

    ``spec``: ``'auto'`` (CSV, plus TensorBoard when installed, else a warning), a list/tuple of
    names among ``csv``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``, ``comet`` (or
    ``comet_ml``), ``neptune`` and/or ``Logger`` instances, or ``[]``/None for none. The spec is checked on every process (an invalid one fails everywhere alike); only
    where ``enabled`` (the main process) are loggers constructed. ``resume_step``: a resumed run,
    whose logs drop what was written after that step's checkpoint; ``hyperparams`` are logged;
    ``runs`` is ``FitState.tracker_runs`` (the trackers' run ids, checkpointed), given to every
    logger's ``attach``.
    A resume is recorded in ``logs/resumes.jsonl`` (its step and time), so that a logger left out
    of a resumed run and enabled again later also drops what it logged past that run's step.
    """
    if not enabled:
        if not (isinstance(spec, str) and spec.strip().lower() == "auto"):  # no warning on every rank
            _check_one_run_each(_normalise(spec))
        return []
    items = _normalise(spec)
    _check_one_run_each(items)
    log_dir = Path(output_dir) / "logs"
    loggers = [item if isinstance(item, Logger) else _by_name(item, log_dir) for item in items]
    resumes = _record_resume(log_dir, resume_step) if resume_step is not None and (loggers or log_dir.is_dir()) else []
    for lg in loggers:
        lg.attach(log_dir, runs if runs is not None else {})
        if resume_step is not None:
            lg.resume(_drop_after(lg, resume_step, resumes))
        if hyperparams is not None:
            lg.log_hyperparams(hyperparams)
    return loggers


def _check_one_run_each(items: list[str | Logger]) -> None:
    """Two trackers of one kind (``"wandb"`` and a ``WandbLogger``, say) would share the one run
    id a checkpoint keeps for that kind, so a resumed fit would continue one of their runs in
    both: refused (on every rank, before anything is constructed)."""
    kinds = [item.run_key if isinstance(item, TrackerLogger) else item for item in items
             if isinstance(item, TrackerLogger) or item in TRACKERS]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise ConfigError(f"loggers holds two {twice[0]} loggers; a checkpoint keeps one {twice[0]} run id, so a "
                          f"resumed fit could not continue both runs: pass one (the name {twice[0]!r} or one "
                          "instance with its options)", settings=("loggers",))


def log_result(loggers: list[Logger], result: Any) -> None:
    """Give every logger the ``FitResult`` of a fit that ended normally (the trackers record its
    numbers and close their runs as a success)."""
    for lg in loggers:
        lg.log_result(result)


def _record_resume(log_dir: Path, step: int) -> list[tuple[int, int]]:
    """Append this resume (step, ``time_ns``) to ``log_dir/resumes.jsonl``; returns every resume
    recorded there, this one last (a torn or unreadable line is skipped)."""
    path = log_dir / RESUMES
    records: list[tuple[int, int]] = []
    text = ""
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        for line in text.splitlines():
            try:
                obj = json.loads(line)
                records.append((int(obj["step"]), int(obj["time_ns"])))
            except (ValueError, KeyError, TypeError):
                continue
    log_dir.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(("\n" if text and not text.endswith("\n") else "") + json.dumps({"step": step, "time_ns": now}) + "\n")
    return [*records, (step, now)]


def _drop_after(lg: Logger, step: int, resumes: list[tuple[int, int]]) -> int:
    """The step after which ``lg`` drops what it logged: ``step``, or the step of an earlier resume
    made after it last wrote, when that is smaller: the run resumed then (without this logger)
    replaced what it had logged past that step. A logger that cannot tell when it wrote: ``step``."""
    written = lg.last_written_ns()
    if written is None:
        return step
    return min([step] + [s for s, t in resumes if t > written])


__all__ = ["LOGGER_ALIASES", "LOGGER_NAMES", "OWN_LOG_FILES", "CSVLogger", "CometLogger", "JSONLLogger", "Logger",
           "MLflowLogger", "NeptuneLogger", "WandbLogger",
           "build_loggers", "log_result", "own_log_files", "tensorboard_available"]

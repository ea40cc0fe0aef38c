"""What the tracker loggers (W&B, MLflow, Comet, Neptune) share: the library imported when the
logger is built, the run started at the first record, and its id kept in the checkpoint so that a
resumed fit continues it.

The id lives in ``FitState.tracker_runs`` (``{"wandb": id, "mlflow": id, ...}``), which every
checkpoint's ``trainer_state.json`` holds: a fit resumed from a checkpoint gets the map back
before its loggers are built (``attach``), and a tracker logger continues the run named there
instead of starting another one.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from lightlike.errors import ConfigError
from lightlike.loggers.base import Logger
from lightlike.loggers.params import result_numbers

log = logging.getLogger("lightlike")


def import_library(name: str, extra: str, logger: str) -> ModuleType:
    """``import name``; a missing library is one error naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"the {logger} logger needs the {name} package, which is not installed: "
                          f"pip install 'lightlike[{extra}]', or drop {logger!r} from loggers",
                          settings=("loggers",)) from e


class TrackerLogger(Logger):
    """A logger whose records go to one run of a tracking service (W&B, MLflow, Comet, Neptune).

    Subclasses set ``run_key`` and implement ``start`` (begin or continue the run, return its id),
    ``record_result`` (the numbers of the fit's result) and ``end`` (close the run: a success
    when the fit returned its result, else failed)."""

    run_key = ""  #: the key of this tracker's run id in ``FitState.tracker_runs``

    def __init__(self) -> None:
        self.log_dir: Path | None = None
        self.runs: dict[str, str] = {}
        self.run_id: str | None = None  #: the id of the run this logger is writing to (None: none open)
        self.succeeded = False

    def attach(self, log_dir: Path, runs: dict[str, str]) -> None:
        self.log_dir, self.runs = Path(log_dir), runs

    def resume(self, step: int) -> None:
        """Nothing to drop: a tracker cannot take back what it recorded after ``step``. The resumed
        fit records those steps again, in the run the checkpoint names (docs/logging.md)."""

    def saved_run_id(self) -> str | None:
        """The id of the run to continue: the one the checkpoint holds (None on a fresh fit)."""
        return self.runs.get(self.run_key)

    def ensure_started(self) -> None:
        """Start (or continue) the run on first use; its id goes into the checkpointed map."""
        if self.run_id is None:
            self.succeeded = False
            self.run_id = self.start()
            self.runs[self.run_key] = self.run_id

    def log_result(self, result: Any) -> None:
        """The result's numbers (``result_numbers``) recorded; the run is then closed as a success."""
        self.ensure_started()
        self.record_result(result_numbers(result))
        self.succeeded = True

    def finalize(self) -> None:
        """Close the run. A tracker that fails to (its server unreachable, say) is warned about,
        not raised: ``finalize`` runs while a fit's own error propagates, which it must not hide,
        and a fit that returned has trained and checkpointed what it returns."""
        if self.run_id is None:
            return
        try:
            self.end(self.succeeded)
        except Exception as e:
            log.warning("the %s run %s could not be closed as %s: %s: %s", self.run_key, self.run_id,
                        "a success" if self.succeeded else "failed", type(e).__name__, e)
        finally:
            self.run_id = None

    def start(self) -> str:
        raise NotImplementedError

    def end(self, succeeded: bool) -> None:
        raise NotImplementedError

    def record_result(self, numbers: dict[str, float]) -> None:
        raise NotImplementedError


__all__ = ["TrackerLogger", "import_library"]

"""The ``Logger`` interface: metrics by step, hyperparameters, resume without duplicates.

Call order the loop follows (main process only; other ranks get no loggers):

1. construct (cheap: no file is opened, no event file is created, no tracker run started);
   then ``attach(log_dir, runs)``: the run's ``logs/`` folder and the checkpointed tracker run ids;
2. ``resume(step)`` once, only when the run resumes from a checkpoint taken at ``step``,
   *before* anything is logged;
3. ``log_hyperparams(config)``;
4. ``log_metrics(metrics, step)`` / ``log_text(tag, text, step)`` any number of times, and
   ``flush()`` before every checkpoint save (a run killed later has its steps up to the
   checkpoint on disk, so the resumed run continues without a gap);
5. ``log_result(result)`` when the fit returns its ``FitResult`` (not on error);
6. ``finalize()`` once, also on error. Logging after ``finalize`` reopens the files in append
   mode, so a second ``fit`` with the same logger keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Logger:
    """Receives the numbers the loop logs. Subclasses implement at least ``log_metrics``."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (name -> number, NaN/inf included) at optimizer step ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics(metrics, step)")

    def attach(self, log_dir: Path, runs: dict[str, str]) -> None:
        """Called once per fit, before anything else: ``log_dir`` is the run's ``output_dir/logs``
        (where a logger constructed without a folder writes), ``runs`` is ``FitState.tracker_runs``,
        saved in every checkpoint. A tracker (W&B, MLflow, Comet, Neptune) reads the id of the run to continue
        there on a resume, and stores the id of the run it starts, so the next resume continues
        it too."""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's configuration (values may be any type: strings, lists, None...)."""

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Record a piece of text; loggers without a text channel ignore it."""

    def log_result(self, result: Any) -> None:
        """Record the ``FitResult`` of a fit that ended normally (loggers of files ignore it)."""

    def resume(self, step: int) -> None:
        """Called before the first log of a run resumed from a checkpoint taken at ``step``:
        drop what was logged after ``step``, so no step appears twice and none is missing."""

    def last_written_ns(self) -> int | None:
        """When this logger's files were last written (``time_ns``), or None where it cannot tell
        (then a resume drops only what was logged after its own checkpoint's step)."""
        return None

    def flush(self) -> None:
        """Hand buffered records to the file system; called before every checkpoint save."""

    def finalize(self) -> None:
        """Flush and close; called once when the fit ends (normally or by an exception)."""


__all__ = ["Logger"]

"""The ``Logger`` interface: metrics by step, hyperparameters, resume without duplicates."""

from __future__ import annotations

from typing import Any


class Logger:
    """Receives the numbers the loop logs. Only the main process has loggers."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def resume(self, step: int) -> None:
        """Called before the first log of a run resumed from a checkpoint taken at ``step``:
        drop what was logged after ``step``, so no step appears twice and none is missing."""

    def finalize(self) -> None:
        pass

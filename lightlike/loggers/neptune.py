"""Neptune: a Neptune run per fit, continued by a resumed fit (neptune imported lazily).

The run holds the config under ``config/`` (flattened as for MLflow: dotted names, ``None`` and
lists as JSON text), every logged metric as a float series with its optimizer step, the numbers
of the ``FitResult`` as fields ``result/...``, and ``sys/failed`` set when the fit raised.
Neptune's float series cannot hold NaN or inf (it drops them): such a value goes, as text, to
the string series ``nonfinite/<key>`` at its step, with a warning naming the key, so it is never
out of sight.

Neptune's environment variables stay in charge where no option is passed: ``NEPTUNE_PROJECT``,
``NEPTUNE_API_TOKEN``, ``NEPTUNE_MODE`` (``offline``: no server, ``neptune sync`` uploads later;
``debug``: nothing written), ``NEPTUNE_DATA_DIRECTORY``. Without ``NEPTUNE_DATA_DIRECTORY`` the
run's files go under ``output_dir/logs/neptune/``: Neptune reads that folder from the variable
only, so it is set while ``neptune.init_run`` runs and restored right after.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightlike.loggers.params import flat_params
from lightlike.loggers.tracker import TrackerLogger, import_library

log = logging.getLogger("lightlike")
#: Neptune's modes whose runs live in local files only and cannot be continued by id
LOCAL_MODES = ("offline", "debug")


@contextmanager
def data_directory(path: Path | None) -> Iterator[None]:
    """``NEPTUNE_DATA_DIRECTORY`` set to ``path`` inside the block where it is unset (and ``path``
    given), restored after it."""
    if path is None or "NEPTUNE_DATA_DIRECTORY" in os.environ:
        yield
        return
    path.mkdir(parents=True, exist_ok=True)
    os.environ["NEPTUNE_DATA_DIRECTORY"] = str(path)
    try:
        yield
    finally:
        os.environ.pop("NEPTUNE_DATA_DIRECTORY", None)


class NeptuneLogger(TrackerLogger):
    """Logs to a Neptune run. ``project``, ``name``, ``tags``, ``mode``, ``api_token`` and any other
    keyword go to ``neptune.init_run`` (an option left None is not passed, so Neptune reads its
    environment variable). The run starts at the fit's first record, on the main process only; a
    fit resumed from a checkpoint continues the run that checkpoint names (``with_id=``) unless
    ``with_id=``/``custom_run_id=`` says which run to write to. An offline run cannot be continued
    (Neptune keeps it in local files until ``neptune sync``): a resumed offline fit starts a new
    run, whose field ``lightlike/resumed_from`` names the one it continues, and warns."""

    run_key = "neptune"

    def __init__(self, project: str | None = None, name: str | None = None, tags: Iterable[str] | None = None, *,
                 mode: str | None = None, api_token: str | None = None, **init_kwargs: Any) -> None:
        super().__init__()
        self.neptune = import_library("neptune", "neptune", "neptune")  # fails here, not at the first log
        options = {"project": project, "name": name, "tags": list(tags) if tags is not None else None,
                   "mode": mode, "api_token": api_token}
        self.init_kwargs = {**{k: v for k, v in options.items() if v is not None}, **init_kwargs}
        self.run: Any = None
        self.warned: set[str] = set()

    def start(self) -> str:
        kwargs = dict(self.init_kwargs)
        mode = str(kwargs.get("mode") or os.environ.get("NEPTUNE_MODE") or "async")
        saved = self.saved_run_id()
        chosen = "with_id" in kwargs or "custom_run_id" in kwargs or os.environ.get("NEPTUNE_CUSTOM_RUN_ID")
        local = mode in LOCAL_MODES
        if saved and not chosen and not local:
            kwargs["with_id"] = saved
        with data_directory(self.log_dir / "neptune" if self.log_dir is not None else None):
            self.run = self.neptune.init_run(**kwargs)
        run_id = self.run.get_url().rsplit("/", 1)[-1] if local else str(self.run["sys/id"].fetch())
        if saved and not chosen and local:
            self.run["lightlike/resumed_from"] = saved
            log.warning("Neptune cannot continue the %s run %s: this resumed fit writes the new run %s "
                        "(its field lightlike/resumed_from names %s)", mode, saved, run_id, saved)
        return run_id

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.ensure_started()
        for key, value in flat_params(params).items():
            self.run[f"config/{key}"] = value

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.ensure_started()
        for key, value in metrics.items():
            value = float(value)
            if math.isfinite(value):
                self.run[str(key)].append(value, step=int(step))
            else:
                self._nonfinite(str(key), value, int(step))

    def _nonfinite(self, key: str, value: float, step: int) -> None:
        self.run[f"nonfinite/{key}"].append(str(value), step=step)
        if key not in self.warned:
            self.warned.add(key)
            log.warning("Neptune cannot hold %s in a float series: %s at step %d (and any later non-finite value "
                        "of it) is recorded as text in nonfinite/%s", value, key, step, key)

    def record_result(self, numbers: dict[str, float]) -> None:
        for key, value in numbers.items():
            self.run[key] = value if math.isfinite(value) else str(value)

    def end(self, succeeded: bool) -> None:
        run, self.run = self.run, None
        try:
            if not succeeded:
                run["sys/failed"] = True
        finally:
            run.stop()


__all__ = ["LOCAL_MODES", "NeptuneLogger"]

"""Comet: a Comet experiment per fit, continued by a resumed fit (comet_ml imported lazily).

Started with ``comet_ml.start`` (``mode="create"`` for a fresh fit, so an experiment the script
has open is left alone; ``mode="get"`` with the checkpoint's experiment key on a resume). The
experiment holds the config as parameters (flattened as for MLflow: dotted names, ``None`` and
lists as JSON text), every logged metric with its optimizer step (NaN and inf as they are), the
numbers of the ``FitResult`` as metrics ``result/...`` at the last step, and the fit's outcome as
the ``lightlike_status`` other (``finished`` or ``failed``).

Comet's own settings stay in charge where no option is passed: ``COMET_API_KEY``,
``COMET_WORKSPACE``, ``COMET_PROJECT_NAME``, ``COMET_START_ONLINE`` (``false``: offline),
``COMET_OFFLINE_DIRECTORY``. An offline experiment is a zip (``<key>.zip``; a resumed fit's
``<key>-<random>.zip``) under ``output_dir/logs/comet/`` unless ``offline_directory=`` or
``COMET_OFFLINE_DIRECTORY`` says where; ``comet upload`` sends it later.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from lightlike.loggers.params import flat_params
from lightlike.loggers.tracker import TrackerLogger, import_library

#: the "other" (a text field of the experiment) holding how the fit ended: finished or failed
STATUS = "lightlike_status"


class CometLogger(TrackerLogger):
    """Logs to a Comet experiment. ``project_name`` (or ``project``, Lightning's name), ``workspace``
    and ``api_key`` go to ``comet_ml.start``; ``online=False`` writes an offline experiment
    (default: Comet's ``COMET_START_ONLINE``, else online); ``name``, ``tags``, ``offline_directory`` and any other
    keyword (a field of ``comet_ml.ExperimentConfig``: ``auto_output_logging=False``, ...) go to
    its ``experiment_config``. The experiment starts at the fit's first record, on the main process
    only; a fit resumed from a checkpoint continues the experiment that checkpoint names, unless
    ``experiment_key=`` says which experiment to write to (created if it does not exist)."""

    run_key = "comet"

    def __init__(self, project_name: str | None = None, name: str | None = None, tags: Iterable[str] | None = None,
                 *, workspace: str | None = None, online: bool | None = None, api_key: str | None = None,
                 offline_directory: str | os.PathLike[str] | None = None, project: str | None = None,
                 experiment_key: str | None = None, **experiment_config: Any) -> None:
        super().__init__()
        self.comet = import_library("comet_ml", "comet", "comet")  # fails here, not at the first log
        self.experiment_key = experiment_key
        self.start_kwargs = {k: v for k, v in {"project_name": project_name or project, "workspace": workspace,
                                                "online": online, "api_key": api_key}.items() if v is not None}
        options = {"name": name, "tags": list(tags) if tags is not None else None,
                   "offline_directory": os.fspath(offline_directory) if offline_directory is not None else None}
        self.experiment_config = {**{k: v for k, v in options.items() if v is not None}, **experiment_config}
        self.experiment: Any = None

    def start(self) -> str:
        config = dict(self.experiment_config)
        if "offline_directory" not in config and not os.environ.get("COMET_OFFLINE_DIRECTORY") \
                and self.log_dir is not None:
            (self.log_dir / "comet").mkdir(parents=True, exist_ok=True)
            config["offline_directory"] = str(self.log_dir / "comet")
        saved = self.saved_run_id()
        where = {"experiment_key": saved, "mode": "get"} if saved else {"mode": "create"}
        if self.experiment_key:
            where = {"experiment_key": self.experiment_key, "mode": "get_or_create"}
        self.experiment = self.comet.start(**self.start_kwargs, **where,
                                           experiment_config=self.comet.ExperimentConfig(**config))
        return str(self.experiment.get_key())

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.ensure_started()
        self.experiment.log_parameters(flat_params(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.ensure_started()
        self.experiment.log_metrics({str(k): float(v) for k, v in metrics.items()}, step=int(step))

    def record_result(self, numbers: dict[str, float]) -> None:
        self.experiment.log_metrics(numbers, step=int(numbers.get("result/global_step", 0)))

    def end(self, succeeded: bool) -> None:
        experiment, self.experiment = self.experiment, None
        try:
            experiment.log_other(STATUS, "finished" if succeeded else "failed")
        finally:
            experiment.end()


__all__ = ["CometLogger"]

"""MLflow: an MLflow run per fit, continued by a resumed fit (mlflow imported lazily).

Written through ``MlflowClient`` (not the fluent ``mlflow.start_run``), so the process's active
run, if the script has one, is left alone. The run holds the config as params (flattened, as
text), every logged metric with its optimizer step, and the numbers of the ``FitResult`` as
metrics ``result/...`` at the last step.

MLflow's environment variables stay in charge where no option is passed: ``MLFLOW_TRACKING_URI``
(or ``mlflow.set_tracking_uri``), ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_EXPERIMENT_ID``,
``MLFLOW_RUN_ID``. Without a tracking URI the store is ``sqlite:///<output_dir>/logs/mlflow.db``
(a local database, no server: ``mlflow ui --backend-store-uri sqlite:///...`` shows it; MLflow 3
refuses its file store ``./mlruns`` unless ``MLFLOW_ALLOW_FILE_STORE=true``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from lightlike.errors import ConfigError
from lightlike.loggers.params import flat_params
from lightlike.loggers.tracker import TrackerLogger, import_library

log = logging.getLogger("lightlike")
#: the most params (and metrics) one ``log_batch`` call takes (MLflow's limit for params: 100)
BATCH = 100


class MLflowLogger(TrackerLogger):
    """Logs to an MLflow run. ``tracking_uri``: the store (default: ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<output_dir>/logs/mlflow.db``); ``experiment_name`` (default:
    ``MLFLOW_EXPERIMENT_NAME``, else ``MLFLOW_EXPERIMENT_ID``, else MLflow's ``Default``);
    ``run_name`` and ``tags`` of a new run. The run starts at the fit's first record, on the
    main process only; a fit resumed from a checkpoint continues the run that checkpoint names
    unless ``MLFLOW_RUN_ID`` says which run to write to."""

    run_key = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment_name: str | None = None,
                 run_name: str | None = None, tags: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.mlflow = import_library("mlflow", "mlflow", "mlflow")  # fails here, not at the first log
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.client: Any = None

    def resolved_tracking_uri(self) -> str:
        """The store this logger writes to: the option, else MLflow's own setting, else the
        SQLite file in the run's ``logs/``."""
        from mlflow.tracking import get_tracking_uri, is_tracking_uri_set

        if self.tracking_uri:
            return self.tracking_uri
        if is_tracking_uri_set() or self.log_dir is None:  # MLFLOW_TRACKING_URI, mlflow.set_tracking_uri()
            return get_tracking_uri()
        path = (self.log_dir / "mlflow.db").resolve()
        missing = [lib for lib in ("sqlalchemy", "alembic") if importlib.util.find_spec(lib) is None]
        if missing:  # mlflow-skinny leaves out what its SQLite store needs
            raise ConfigError(f"the mlflow logger's default store, sqlite:///{path}, needs {' and '.join(missing)}, "
                              "which mlflow-skinny does not install: pip install 'lightlike[mlflow]', or set "
                              "MLFLOW_TRACKING_URI (or MLflowLogger(tracking_uri=...)) to a store of yours",
                              settings=("loggers",))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"

    def start(self) -> str:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.resolved_tracking_uri())
        run_id = os.environ.get("MLFLOW_RUN_ID") or self.saved_run_id()
        if run_id:
            try:
                self.client.update_run(run_id, status="RUNNING")
                return run_id
            except MlflowException as e:  # the checkpoint's run is not in this store
                log.warning("the MLflow run %s to continue is not in %s (%s): starting a new run",
                            run_id, self.client.tracking_uri, e)
        run = self.client.create_run(self._experiment_id(), run_name=self.run_name, tags=self.tags)
        return str(run.info.run_id)

    def _experiment_id(self) -> str:
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # "0": MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.ensure_started()
        values = {k: str(v) for k, v in flat_params(params).items()}
        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in values.items() if k in logged and logged[k] != v)
        if changed:  # MLflow refuses to change a param: the run keeps the first fit's values
            log.warning("MLflow keeps a run's params as first logged: run %s keeps %s (this fit: %s)", self.run_id,
                        ", ".join(f"{k}={logged[k]}" for k in changed), ", ".join(f"{k}={values[k]}" for k in changed))
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        for i in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.ensure_started()
        self._log_numbers(metrics, int(step))

    def _log_numbers(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(str(k), float(v), now, step) for k, v in numbers.items()]  # NaN/inf as they are
        for i in range(0, len(rows), BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i:i + BATCH])

    def record_result(self, numbers: dict[str, float]) -> None:
        self._log_numbers(numbers, int(numbers.get("result/global_step", 0)))

    def end(self, succeeded: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if succeeded else "FAILED")


__all__ = ["MLflowLogger"]

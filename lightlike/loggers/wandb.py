"""Weights & Biases: a W&B run per fit, continued by a resumed fit (wandb imported lazily).

What the run holds: the config (``run.config``, as JSON), every logged row with the optimizer step
as ``train/global_step`` (the x-axis of every chart: ``define_metric("*", step_metric=...)``, as
the HF Trainer and Lightning do; W&B's own ``_step`` counts rows and restarts in an offline resume),
and the numbers of the ``FitResult`` in the run's summary (``result/...``).

W&B's environment variables stay in charge where no option is passed: ``WANDB_MODE``
(``offline``, ``disabled``), ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_DIR``, ``WANDB_RUN_ID``.
Without ``dir=`` and ``WANDB_DIR`` the run's files go under ``output_dir/logs/wandb/``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from lightlike.loggers.params import as_json
from lightlike.loggers.tracker import TrackerLogger, import_library

#: the metric every row carries and every chart plots against: lightlike's optimizer step
STEP = "train/global_step"


class WandbLogger(TrackerLogger):
    """Logs to a W&B run. ``project``, ``name``, ``tags``, ``entity``, ``group``, ``notes``,
    ``mode``, ``dir`` and any other keyword go to ``wandb.init`` (an option left None is not
    passed, so W&B reads its environment variable). The run starts at the fit's first record,
    on the main process only; a fit resumed from a checkpoint continues the run that checkpoint
    names (``wandb.init(id=..., resume="allow")``) unless ``id=`` or ``WANDB_RUN_ID`` says
    which run to write to."""

    run_key = "wandb"

    def __init__(self, project: str | None = None, name: str | None = None, tags: Iterable[str] | None = None, *,
                 entity: str | None = None, group: str | None = None, notes: str | None = None,
                 mode: str | None = None, dir: str | os.PathLike[str] | None = None, **init_kwargs: Any) -> None:
        super().__init__()
        self.wandb = import_library("wandb", "wandb", "wandb")  # fails here, not at the first log
        options = {"project": project, "name": name, "tags": list(tags) if tags is not None else None,
                   "entity": entity, "group": group, "notes": notes, "mode": mode,
                   "dir": os.fspath(dir) if dir is not None else None}
        self.init_kwargs = {**{k: v for k, v in options.items() if v is not None}, **init_kwargs}
        self.run: Any = None

    def start(self) -> str:
        kwargs = dict(self.init_kwargs)
        if "dir" not in kwargs and not os.environ.get("WANDB_DIR") and self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(self.log_dir)
        saved = self.saved_run_id()
        if saved and "id" not in kwargs and not os.environ.get("WANDB_RUN_ID"):
            kwargs["id"] = saved
            kwargs.setdefault("resume", "allow")
        kwargs.setdefault("reinit", "create_new")  # this fit's own run, beside any the script started
        self.run = self.wandb.init(**kwargs)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP, step_sync=True)
        return str(self.run.id)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.ensure_started()
        # a resumed fit may change settings (max_steps, say): the run's config shows this fit's
        self.run.config.update(as_json(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.ensure_started()
        self.run.log({**{str(k): float(v) for k, v in metrics.items()}, STEP: int(step)})

    def record_result(self, numbers: dict[str, float]) -> None:
        self.run.summary.update(numbers)

    def end(self, succeeded: bool) -> None:
        run, self.run = self.run, None
        run.finish(exit_code=0 if succeeded else 1)


__all__ = ["STEP", "WandbLogger"]

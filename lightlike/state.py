"""The loop's state (``FitState``), the callbacks' control flags (``Control``), the result."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FitState:
    """Where the fit stands. Goes into every checkpoint; callbacks read it."""

    global_step: int = 0  # optimizer steps taken (skipped overflow steps included)
    max_steps: int = 0  # the resolved total number of optimizer steps
    epoch: float = 0.0  # epochs completed, fractional within an epoch
    epoch_index: int = 0  # the integer epoch being run
    batches_in_epoch: int = 0  # micro-batches consumed in the current epoch (this rank)
    samples_in_epoch: int = 0  # global samples consumed in the current epoch (sampler position)
    samples_seen: int = 0  # training samples consumed (all epochs)
    items_seen: float = 0.0  # loss items (num_items) consumed; read at log steps
    skipped_steps: int = 0  # steps whose update was skipped (loss-scale overflow, nonfinite 'skip')
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_step: int | None = None  # the step whose evaluation gave best_metric
    best_checkpoint: str | None = None
    last_eval_step: int = -1
    last_save_step: int = -1
    # a stop asked for before min_steps / min_epochs were reached, waiting for them (lightlike/stop_gate.py)
    stop_deferred: bool = False
    # the trackers' run ids ({"wandb": id, "mlflow": id}): a resumed fit continues those runs
    tracker_runs: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def state_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """Restore in place (callbacks and the checkpointer hold this object)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, data[f.name] if f.name in data else f.default_factory()  # type: ignore[misc]
                    if f.default is dataclasses.MISSING else f.default)

    def last_evaluation(self) -> dict[str, float]:
        """The metrics of the last evaluation, from the log history ({} before any): what a
        resumed run reports if it evaluates no more, as the uninterrupted run did."""
        return {k: v for entry in self.log_history if entry.get("step") == self.last_eval_step
                for k, v in entry.items() if k != "step" and not k.startswith("train/")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def check_saved(cls, data: Any, where: str) -> None:
        """``data`` as ``to_dict`` writes it, or ``CheckpointError`` naming ``where`` (the file)
        and the first field that is not: counts are integers >= 0 (the steps of the last
        evaluation and save >= -1), ``epoch`` and ``items_seen`` numbers >= 0, the rest of their types."""
        from lightlike.errors import CheckpointError

        def bad(name: str, value: Any, want: str) -> CheckpointError:
            return CheckpointError(f"{where}: {name} is {value!r}, not {want}: the file is not as lightlike writes "
                                   "it (edited by hand?); resume from another checkpoint")

        if not isinstance(data, dict):
            raise bad("state", data, "an object of the fit's counters")
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            v, least = data[f.name], _LEAST.get(f.name)
            is_int = isinstance(v, int) and not isinstance(v, bool)
            if least is not None and not (is_int and v >= least):
                raise bad(f.name, v, f"an integer >= {least}")
            if f.name in ("epoch", "items_seen") and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                           and math.isfinite(v) and v >= 0):
                raise bad(f.name, v, "a finite number >= 0")
            if f.name == "best_metric" and not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))):
                raise bad(f.name, v, "a number or null")
            if f.name == "best_step" and not (v is None or (is_int and v >= 0)):
                raise bad(f.name, v, "an integer >= 0 or null")
            if f.name == "stop_deferred" and not isinstance(v, bool):
                raise bad(f.name, v, "true or false")
            if f.name == "best_checkpoint" and not (v is None or isinstance(v, str)):
                raise bad(f.name, v, "a checkpoint's name or null")
            if f.name == "log_history" and not (isinstance(v, list) and all(isinstance(r, dict) for r in v)):
                raise bad(f.name, v if not isinstance(v, list) else "[...]", "a list of log rows (objects)")
            if f.name == "tracker_runs" and not (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())):
                raise bad(f.name, v, "an object of tracker names to run ids")

    @classmethod
    def saved_in(cls, checkpoint: str | Path) -> FitState | None:
        """The state saved in a checkpoint directory; None for a weights-only one."""
        from lightlike.checkpoint.files import TRAINER_STATE_FILE

        path = Path(checkpoint) / TRAINER_STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        cls.check_saved(data.get("state") if isinstance(data, dict) else data, str(path))
        return cls.from_dict(data["state"])


#: the least value of each integer counter of ``FitState`` (``check_saved``)
_LEAST = {"global_step": 0, "max_steps": -1, "epoch_index": 0, "batches_in_epoch": 0, "samples_in_epoch": 0,
          "samples_seen": 0, "skipped_steps": 0, "last_eval_step": -1, "last_save_step": -1}


@dataclass
class Control:
    """Flags callbacks set to steer the loop. The loop resets each flag once it has acted."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def pending(self) -> bool:
        """Whether any flag is set."""
        return (self.should_training_stop or self.should_epoch_stop or self.should_save or self.should_evaluate
                or self.should_log)


@dataclass
class FitResult:
    """What ``Fitter.fit`` returns."""

    global_step: int
    training_loss: float  # item-weighted mean training loss over the whole fit
    # the last evaluation's metrics, and train/loss = training_loss (the whole fit's mean, as the HF
    # Trainer's train_loss; the last log line's train/loss is the mean of its own window only)
    metrics: dict[str, float]
    runtime: float  # seconds
    samples_per_second: float
    steps_per_second: float
    peak_memory_bytes: int | None  # device peak (CUDA) or host max RSS (CPU)
    skipped_steps: int = 0
    best_checkpoint: str | None = None
    # the checkpoint of the last step: the final weights (unless load_best_at_end loaded the best's
    # into the module); None with save_strategy='no'
    last_checkpoint: str | None = None
    state: FitState | None = None
    # compile=True: seconds the first call of each compiled function took (training step and
    # evaluation step: tracing and compiling, forward and backward); None without compile
    compile_seconds: float | None = None


@dataclass
class PredictionResult:
    """What ``Fitter.predict`` returns: predictions in dataset order, labels if the batches
    carry them, and the metrics over the whole set."""

    predictions: Any
    labels: Any
    metrics: dict[str, float]

"""The loop's state (``FitState``), the callbacks' control flags (``Control``), the result."""

from __future__ import annotations

import dataclasses
import json
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
    def saved_in(cls, checkpoint: str | Path) -> FitState | None:
        """The state saved in a checkpoint directory; None for a weights-only one."""
        from lightlike.checkpoint.files import TRAINER_STATE_FILE

        path = Path(checkpoint) / TRAINER_STATE_FILE
        return cls.from_dict(json.loads(path.read_text())["state"]) if path.is_file() else None


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

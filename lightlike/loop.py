"""What the loop in ``fitter.py`` carries through one ``fit``: the objects it set up
(``FitRun``), what is due at a step boundary (``BoundaryPlan``) and whether a checkpoint is
(``save_due``).

``BoundaryPlan`` and ``save_due`` are values and functions of numbers and the callbacks' flags:
they decide, the Fitter's ``_carry_out`` acts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from lightlike.best import BestMetric
from lightlike.config import FitConfig
from lightlike.data.loading import TrainData
from lightlike.evaluation import forward_loss
from lightlike.pending import LossBuffer
from lightlike.state import Control, FitResult, FitState
from lightlike.utils.memory import peak_memory_bytes

log = logging.getLogger("lightlike")


@dataclass
class FitRun:
    """What one ``fit`` set up and carries from step to step, besides what the Fitter holds under
    public names for callbacks (``state``, ``control``, ``module``, ``model``, ``optimizer``,
    ``scheduler``, ``checkpointer``): each object has this one owner."""

    train_data: TrainData
    eval_sets: dict[str, Any]
    best: BestMetric  # metric_for_best: the best evaluation so far, and a key the evaluation lacks
    max_steps: int
    epoch_limit: float  # epochs to run (inf when only max_steps bounds the fit)
    losses: LossBuffer
    agree_on_data: bool  # several ranks whose shares may run out at different steps
    limit: Any = None  # limit_train_batches: lightlike.data.limits.TrainLimit
    resume_from: Any = None  # the checkpoint this fit resumed from (a Path), or None
    ctx: Any = None  # the StepContext of every training step (lightlike/step.py)
    training_step: Callable[[list[Any], Any], None] | None = None  # (window, ctx): AutomaticStep or ManualStep
    manual: Any = None  # a module's own training_step (lightlike.manual.ManualStep), or None
    grad_norm: torch.Tensor | None = None  # the last step's norm (None: skipped), read at the next log row
    last_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation's
    next_scheduled: int = 0  # the next step the schedule makes something due at (next_scheduled_step)
    bar_active: bool = False  # a progress bar replaces the log lines
    start: tuple[float, int, int] = (0.0, 0, 0)  # (time, global step, samples seen) when the loop began
    # a micro-batch's loss, evaluation.forward_loss; with compile=True the CompiledStep's (which
    # evaluation calls too: ``compiled``), set by lightlike.compiled.compile_run
    forward_loss: Callable[..., torch.Tensor] = forward_loss
    compiled: Any = None

    def result(self, state: FitState, strategy: Any, last_checkpoint: str | None) -> FitResult:
        """What this fit returns: its numbers since the loop began, the mean training loss over
        every rank (collective), and the checkpoints it leaves."""
        start_time, start_step, start_samples = self.start
        runtime = time.perf_counter() - start_time
        training_loss = self.losses.mean_loss(strategy)
        return FitResult(
            global_step=state.global_step,
            training_loss=training_loss,
            metrics={**self.last_metrics, "train/loss": training_loss},
            runtime=runtime,
            samples_per_second=(state.samples_seen - start_samples) / runtime if runtime else 0.0,
            steps_per_second=(state.global_step - start_step) / runtime if runtime else 0.0,
            peak_memory_bytes=peak_memory_bytes(strategy.root_device),
            skipped_steps=state.skipped_steps,
            best_checkpoint=state.best_checkpoint,
            last_checkpoint=last_checkpoint,
            state=state,
            compile_seconds=self.compiled.compile_seconds if self.compiled is not None else None,
        )


class BoundaryPlan(NamedTuple):
    """What the schedule makes due at the boundary after step ``step`` (an immutable value). The
    callbacks' flags (``Control``) are read live by the methods, since a flag set in ``on_log``
    or ``on_evaluate`` counts at the same boundary."""

    step: int
    log_step: bool  # log_every divides the step
    eval_step: bool  # eval_every divides the step
    save_step: bool  # save_every divides the step (save_strategy="steps")
    last_step: bool  # the step budget is spent
    epoch_done: bool  # the data of this epoch is used up
    last_epoch: bool  # the epoch being run is the last one
    has_eval_sets: bool
    eval_at_epoch_end: bool  # eval_on_epoch_end, with evaluation data

    @classmethod
    def at(cls, step: int, config: FitConfig, *, max_steps: int, epoch_done: bool, epoch_index: int,
           epoch_limit: float, has_eval_sets: bool) -> BoundaryPlan:
        return cls(step=step, log_step=step % config.log_every == 0,
                   eval_step=has_eval_sets and bool(config.eval_every) and step % config.eval_every == 0,  # type: ignore[operator]
                   save_step=scheduled_save(config, step),
                   last_step=step >= max_steps, epoch_done=epoch_done, last_epoch=epoch_index + 1 >= epoch_limit,
                   has_eval_sets=has_eval_sets, eval_at_epoch_end=config.eval_on_epoch_end and has_eval_sets)

    @classmethod
    def epoch_end(cls, step: int, config: FitConfig, *, epoch_index: int, epoch_limit: float,
                  has_eval_sets: bool) -> BoundaryPlan:
        """The epoch's data ran out after step ``step``, whose own boundary has passed: only the
        epoch's end is due (and what it brings: its evaluation, its save, the run's end)."""
        return cls(step=step, log_step=False, eval_step=False, save_step=False, last_step=False, epoch_done=True,
                   last_epoch=epoch_index + 1 >= epoch_limit, has_eval_sets=has_eval_sets,
                   eval_at_epoch_end=config.eval_on_epoch_end and has_eval_sets)

    @classmethod
    def end_of_fit(cls, step: int, *, has_eval_sets: bool) -> BoundaryPlan:
        """The loop ended without a boundary that ended the run (a stop asked for outside one,
        no step left): only the run's end is due."""
        return cls(step=step, log_step=False, eval_step=False, save_step=False, last_step=True, epoch_done=False,
                   last_epoch=True, has_eval_sets=has_eval_sets, eval_at_epoch_end=False)

    def quiet(self, control: Control) -> bool:
        """Nothing is due at this boundary and no callback asked for anything: no log, evaluation,
        epoch end, save or stop (a new best needs an evaluation, so none either)."""
        return not (self.log_step or self.eval_step or self.save_step or self.last_step or self.epoch_done
                    or control.should_log or control.should_evaluate or control.should_save
                    or control.should_epoch_stop or control.should_training_stop)

    def ends_epoch(self, control: Control) -> bool:
        return self.epoch_done or control.should_epoch_stop

    def ends_run(self, control: Control) -> bool:
        return self.last_step or control.should_training_stop or (
            self.last_epoch and (self.epoch_done or control.should_epoch_stop))

    def log(self, control: Control) -> bool:
        """A training row: scheduled, asked for, or the run's last step."""
        return self.log_step or control.should_log or self.ends_run(control)

    def evaluate(self, control: Control, state: FitState) -> bool:
        """An evaluation: scheduled, asked for, at an epoch's end (``eval_on_epoch_end``), or the
        run's last step; once per step."""
        return state.last_eval_step != self.step and (
            self.eval_step or control.should_evaluate or (self.eval_at_epoch_end and self.ends_epoch(control))
            or (self.has_eval_sets and self.ends_run(control)))


def save_due(config: FitConfig, state: FitState, control: Control, epoch_ended: bool, final: bool) -> bool:
    """Whether to save at this step boundary: asked by a callback, or due by ``save_strategy``
    (every ``save_every`` steps, at an epoch's end, at a new best), at a new best with
    ``load_best_at_end`` (the best is always on disk to load), and at the end unless
    ``save_strategy='no'`` (the trained model is kept); never twice at one step (a flag asked
    for then is spent)."""
    step = state.global_step
    if state.last_save_step == step:
        control.should_save = False
        return False
    new_best = state.best_step == step
    return (control.should_save or scheduled_save(config, step)
            or (config.save_strategy == "epoch" and epoch_ended)
            or (new_best and (config.save_strategy == "best" or config.load_best_at_end))
            or (final and config.save_strategy != "no"))


def next_scheduled_step(config: FitConfig, step: int, max_steps: int) -> int:
    """The first step after ``step`` at which the schedule makes something due: a log row, an
    evaluation, a save (``save_strategy="steps"``), the last step. A boundary before it with no
    epoch end and no flag set is quiet, which the loop knows without building a ``BoundaryPlan``."""
    save_every = config.save_every if config.save_strategy == "steps" else None
    due = max_steps
    for every in (config.log_every, config.eval_every, save_every):
        if every:
            due = min(due, (step // every + 1) * every)
    return due


def scheduled_save(config: FitConfig, step: int) -> bool:
    """Whether ``save_strategy="steps"`` saves at ``step`` (``save_every`` divides it)."""
    return config.save_strategy == "steps" and bool(config.save_every) and step % config.save_every == 0  # type: ignore[operator]


def warn_eval_every_past_the_end(config: FitConfig, max_steps: int) -> None:
    """``eval_every`` larger than the run's steps makes no step an evaluation step: the run is
    evaluated at its last step only (and at epoch ends with ``eval_on_epoch_end``). Said once at
    set-up, as the HF Trainer does not (it never evaluates then)."""
    every = config.eval_every
    if every is None or every <= max_steps:
        return
    when = (f"at epoch ends and at the last step ({max_steps})" if config.eval_on_epoch_end
            else f"once, at the last step ({max_steps})")
    log.warning("eval_every=%d is larger than this run's %d optimizer steps: no evaluation falls on an eval_every "
                "step, so the run is evaluated only %s. Set eval_every to at most %d to evaluate during training",
                every, max_steps, when, max_steps)

"""``Fitter``: the training loop, written out in one readable place.

``fit`` reads like a hand-written loop: set up (``_set_up`` returns this fit's ``FitRun``), then
for each epoch, for each optimizer step, take the step's micro-batches (the accumulation window),
forward/backward each with weight ``items_i / items_in_step``, clip, step; then the step
boundary: log, evaluate, end the epoch, save, stop, when due (``BoundaryPlan``, decided once per step);
then the result. Distribution is the ``Strategy``'s business, numerics the ``Precision``
plugin's, and what a checkpoint holds the ``Checkpointer``'s; the loop only calls them.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from lightlike import manual, optim
from lightlike.best import BestMetric
from lightlike.callbacks.base import Callback, CallbackList
from lightlike.callbacks.checks import built_in_callbacks
from lightlike.callbacks.progress import ProgressBar
from lightlike.checkpoint.checkpointer import Checkpointer
from lightlike.checkpoint.frozen import BaseFingerprint
from lightlike.checkpoint.lock import output_dir_locked
from lightlike.checkpoint.registry import user_states
from lightlike.checkpoint.resume import resolve_resume
from lightlike.checkpoint.rotation import prepare_output_dir
from lightlike.checkpoint.training import LoopState, check_within_the_run, saved_fit_state
from lightlike.compiled import compile_run
from lightlike.config import FitConfig, check_keys
from lightlike.data.eval_loading import build_eval_loader, normalise_eval_sets
from lightlike.data.limits import TrainLimit, eval_limits, limited_eval_sets
from lightlike.data.loading import build_train_data
from lightlike.errors import ConfigError, DataError
from lightlike.evaluation import run_evaluation
from lightlike.interop.liger import apply_liger
from lightlike.interop.neftune import attach_neftune
from lightlike.lazy import materialise_lazy_modules
from lightlike.loggers import build_loggers, log_result
from lightlike.loggers.console import setup_logging
from lightlike.loggers.summary import model_summary
from lightlike.loop import BoundaryPlan, FitRun, next_scheduled_step, save_due, warn_eval_every_past_the_end
from lightlike.module import TaskModule, check_task_module
from lightlike.nonfinite import NonFiniteCheck
from lightlike.optimizers.modes import eval_mode
from lightlike.pending import LossBuffer
from lightlike.precision import get_precision
from lightlike.preemption import PreemptionHandler, requeue_slurm_job, waiting_for
from lightlike.state import Control, FitResult, FitState, PredictionResult
from lightlike.step import AutomaticStep, ManualStepContext, StepContext
from lightlike.stop_gate import hold_stop
from lightlike.strategies import Strategy, get_strategy
from lightlike.utils.failfast import decided_on_main, failing_fast, guarded
from lightlike.utils.oom import OutOfMemoryRetry
from lightlike.utils.seed import rng_kept, seed_everything

log = logging.getLogger("lightlike")


class Fitter:
    """Trains, evaluates and predicts with a ``TaskModule``.

    Every keyword is a ``FitConfig`` field (``Fitter(config=cfg, max_steps=10)`` overrides a
    field of ``cfg``). ``callbacks`` is a list of ``Callback`` objects. ``states`` names objects
    of yours with ``state_dict()``/``load_state_dict()`` (``states={"ema": ema}``): each is saved
    in every checkpoint (``state-<name>.pt``, by the main rank) and restored before the first step
    of a resumed fit. During and after a fit,
    ``module``, ``model`` (the module as the strategy wrapped it), ``optimizer``, ``scheduler``,
    ``state``, ``control``, ``strategy``, ``checkpointer``, ``neftune`` (the fit's NEFTune hooks) and
    ``phase`` (what the fit is doing, for error reports) are public.
    """

    def __init__(self, config: FitConfig | None = None, *, callbacks: list[Callback] | None = None,
                 states: dict[str, Any] | None = None, **kwargs: Any):
        check_keys(kwargs, FitConfig)
        self.config = config.replace(**kwargs) if config is not None else FitConfig(**kwargs)
        self.user_callbacks = list(callbacks or [])
        self.states = user_states(states)  # checkpointed with the rest (lightlike/checkpoint/registry.py)
        # seeded here too (as the HF Trainer does), so a module built after the Fitter, as in
        # `Fitter(seed=0).fit(Model(), ...)`, starts from the same weights every run
        seed_everything(self.config.seed)  # (deterministic algorithms: during fit/validate/... only)
        self.strategy: Strategy | None = None
        self.module: TaskModule | None = None  # the user's module
        self.model: Any = None  # what the loop calls: the module as wrapped by the strategy
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.state, self.control = FitState(), Control()
        self.loggers: list[Any] = []
        self.callbacks = CallbackList([])
        self.train_data: Any = None
        self.checkpointer: Checkpointer | None = None
        self.preemption = PreemptionHandler(self.config.preemption_signals)
        self.resumed_from: str | None = None
        self.phase = "set-up"
        self._resume_choice: Path | None = None  # where this fit's first try started (an out-of-memory retry's too)
        self.neftune: Any = None  # a fit's NEFTune hooks (lightlike/interop/neftune.py), removed when it ends

    def init_module(self) -> Any:
        """Context in which to build a module too large for one device: ``with
        fitter.init_module(): module = Model()``. The strategy decides (FSDP: on the meta device,
        materialised shard by shard in ``fit``; DeepSpeed ZeRO-3: partitioned as it is built;
        others: as usual). Sets up the process group first."""
        return self.setup_strategy().module_init_context()

    # ==== fit =====================================================================================
    def fit(self, module: TaskModule, train: Any, val: Any = None, *, resume: bool | str | None = None) -> FitResult:
        """Train ``module`` on ``train``; evaluate on ``val`` (a Dataset/DataLoader or a dict of
        them). ``resume=True`` continues from the newest valid checkpoint in ``output_dir``,
        ``resume="path"`` from that checkpoint. With ``auto_find_batch_size``, a fit that runs
        out of memory starts again with about half the batch (``OutOfMemoryRetry``)."""
        self.config.need_stopping_criterion()
        self.preemption = PreemptionHandler(self.config.preemption_signals)  # one per fit(): kept over retries
        self._resume_choice = None
        try:
            with output_dir_locked(self.setup_strategy(), self.config.output_dir), guarded(self):
                retry = OutOfMemoryRetry(module, train, self.states) if self.config.auto_find_batch_size else None
                while True:
                    try:
                        result = self._fit_once(module, train, val, resume)
                        break
                    except RuntimeError as error:  # torch.OutOfMemoryError is one
                        if retry is None or not retry.applies(error, self.config, self.strategy):
                            raise
                        self._commit()  # the failed try's asynchronous save lands first (on_save too)
                        self.config, resume = retry.next_try(self.config, self.strategy, self._resume_choice)
                if retry is not None and self.checkpointer is not None:
                    retry.release_resume_source(self.checkpointer, self.strategy)
                return result
        finally:
            self.preemption.uninstall()
            self.neftune = attach_neftune(module, None, self.neftune)  # removed, whatever the exit

    def _fit_once(self, module: TaskModule, train: Any, val: Any, resume: bool | str | None) -> FitResult:
        run = self._set_up(module, train, val, resume)
        state, control = self.state, self.control
        try:
            self.callbacks.call("on_fit_start", self, state, control)
            run.bar_active = any(isinstance(cb, ProgressBar) and cb.bar is not None for cb in self.callbacks.callbacks)
            run.start = (time.perf_counter(), state.global_step, state.samples_seen)
            self._train(run)
            self._end_fit(run)
            run.ctx.check.check_trained(state.global_step - run.start[1])  # every step skipped: raises
            self.callbacks.call("on_fit_end", self, state, control)
            result = run.result(state, self.strategy, self.checkpointer.final_checkpoint())  # type: ignore[union-attr]
            log_result(self.loggers, result)  # the trackers record its numbers, their runs end as a success
        finally:
            for lg in self.loggers:
                lg.finalize()
        return result

    def _train(self, run: FitRun) -> None:
        """The loop: epochs of optimizer steps, each followed by its step boundary."""
        state, control = self.state, self.control
        self.model.train()
        run.next_scheduled = next_scheduled_step(self.config, state.global_step, run.max_steps)
        hold_stop(self.config, state, control)  # min_epochs / min_steps (lightlike/stop_gate.py)
        while state.global_step < run.max_steps and not control.should_training_stop \
                and state.epoch_index < run.epoch_limit:
            batches = run.train_data.epoch_iterator(state.epoch_index, state.samples_in_epoch, state.batches_in_epoch)
            position = run.train_data.position(state.samples_in_epoch, state.batches_in_epoch,
                                               self.strategy.world_size)
            batches = run.limit.watch(waiting_for(position.watch(batches), "the training DataLoader's next batch"),
                                      state.batches_in_epoch)
            if state.batches_in_epoch == 0:
                self.callbacks.call("on_epoch_start", self, state, control)
            while state.global_step < run.max_steps:
                self.phase = "train step"
                window = self._next_window(run, batches, position)
                if not window:  # the epoch ran out (its length was not known, or drop_last)
                    self._data_ran_out(run)
                    break
                self.callbacks.call("on_step_start", self, state, control)
                self._training_step(run, window)
                epoch_done = self._advance(position, len(window))
                self.callbacks.call("on_step_end", self, state, control)
                if self._step_boundary(run, epoch_done):
                    break

    # ---- a training step ------------------------------------------------------------------------
    def _next_window(self, run: FitRun, batches: Any, position: Any) -> list[Any]:
        """This step's micro-batches. Ranks whose shares may run out at different steps agree
        on each step that all still have data (every rank must take the same steps)."""
        window = list(itertools.islice(batches, self.config.grad_accum_steps))
        if run.agree_on_data and not position.follows and self.strategy.collectives.reduce_flag(not window) and window:
            log.warning("another rank ran out of training data: skipping this rank's last %d batch(es) of epoch %d",
                        len(window), self.state.epoch_index)
            return []
        return window

    def _training_step(self, run: FitRun, window: list[Any]) -> None:
        """One optimizer step over ``window``: the module's ``training_step``, or the automatic one
        (``lightlike/step.py``), on the fit's step context."""
        step, ctx, to_device = self.state.global_step + 1, run.ctx, self.strategy.batch_to_device
        ctx.begin(step, self.module)
        run.training_step(list(map(to_device, window)), ctx)
        skipped, run.grad_norm = ctx.finish()  # the norm is read at the next log row
        if skipped is not None:
            self.state.skipped_steps += 1
        self.state.global_step = step
        self.phase = "step end"

    def _advance(self, position: Any, micro_batches: int) -> bool:
        """Move the data position past this step's batches; whether the epoch's data is used up."""
        state = self.state
        state.batches_in_epoch += micro_batches
        in_epoch, fraction, epoch_done = position.advance(micro_batches)
        state.samples_seen += in_epoch - state.samples_in_epoch
        state.samples_in_epoch = in_epoch
        state.epoch = state.epoch_index + fraction
        return epoch_done

    # ---- the step boundary ----------------------------------------------------------------------
    def _step_boundary(self, run: FitRun, epoch_done: bool) -> bool:
        """After a step: what is due (``BoundaryPlan``) is done, then a preemption signal is acted on.
        Returns whether the epoch's loop ends here."""
        state, control = self.state, self.control
        epoch_ended = stop = False
        if state.global_step >= run.next_scheduled or epoch_done or control.pending():  # else: nothing is due
            plan = BoundaryPlan.at(state.global_step, self.config, max_steps=run.max_steps, epoch_done=epoch_done,
                                   epoch_index=state.epoch_index, epoch_limit=run.epoch_limit,
                                   has_eval_sets=bool(run.eval_sets))
            if not plan.quiet(control):
                epoch_ended, stop = self._carry_out(run, plan)
            run.next_scheduled = next_scheduled_step(self.config, state.global_step, run.max_steps)
        if control.should_training_stop or state.stop_deferred:
            hold_stop(self.config, state, control)  # held (min_epochs / min_steps), or held no longer
        if self.preemption.stop_requested(self.strategy, state.global_step):
            self._preempted(stop or control.should_training_stop)
        return epoch_ended or control.should_training_stop

    def _carry_out(self, run: FitRun, plan: BoundaryPlan) -> tuple[bool, bool]:
        """The step boundary, for every exit (after a step, data that ran out, the end of the fit):
        log, evaluate, end the epoch, save, stop, in that order, so that a checkpoint taken here
        holds everything done at this step (a resumed run repeats none of it). A flag a callback
        sets during the boundary counts for the stages after its own; a row or an evaluation
        asked for by a later stage's callback, and the run's last ones, come before the save.
        The flags are spent here, once. Returns (whether the epoch ended, whether the run ends)."""
        state, control = self.state, self.control
        if plan.log(control):  # a row due only because the run ends is written if losses are pending
            self._log_training(run, final=not (plan.log_step or control.should_log))
        if plan.evaluate(control, state):
            self._evaluate_all(run)
        epoch_ended = plan.ends_epoch(control)
        if epoch_ended:
            self._end_epoch()
        hold_stop(self.config, state, control)
        stop = plan.ends_run(control) or state.epoch_index >= run.epoch_limit
        if control.should_log or stop:
            self._log_training(run, final=True)
        if (control.should_evaluate or (stop and run.eval_sets)) and state.last_eval_step != state.global_step:
            self._evaluate_all(run)
        control.should_log = control.should_evaluate = control.should_epoch_stop = False
        if save_due(self.config, state, control, epoch_ended, final=stop):
            self._save(wait=False)
        run.best.raise_unknown(state, self._commit)  # a metric_for_best the evaluation lacks: after the save
        return epoch_ended, stop

    def _data_ran_out(self, run: FitRun) -> None:
        """The epoch's data ended before a step (its length was not known, or drop_last): the
        epoch ends at the last step's boundary."""
        state = self.state
        if state.batches_in_epoch == 0:
            raise DataError(f"epoch {state.epoch_index} of the training data produced no batch")
        self._carry_out(run, BoundaryPlan.epoch_end(state.global_step, self.config, epoch_index=state.epoch_index,
                                        epoch_limit=run.epoch_limit, has_eval_sets=bool(run.eval_sets)))

    def _preempted(self, ending: bool) -> None:
        """A preemption signal, agreed by every rank: save a full checkpoint (once), ask SLURM to
        requeue, and exit with code 75 (``Preempted``); at the run's last step it just ends."""
        name = self.preemption.signal_name or "a signal on another rank"
        step = self.state.global_step
        if ending:
            log.warning("%s received at the run's last step %d: it ends normally (no requeue)", name, step)
            return
        log.warning("%s received: saving a checkpoint at step %d and exiting", name, step)
        self.preemption.finish_vote()
        # always a full, resumable checkpoint (also over this step's weights-only one)
        resave = self.state.last_save_step != step or self.config.save_only_model
        path = self._save(full=True) if resave else None
        self._commit()  # this step's save may still be in flight
        if self.config.requeue_on_preemption and self.strategy.is_global_zero:
            requeue_slurm_job()
        raise self.preemption.preempted(name, str(path) if path else f"{self.config.output_dir}/checkpoint-{step}")

    def _end_epoch(self) -> None:
        """End the epoch at this step boundary: the callbacks' ``on_epoch_end``, and the data
        position moves to the start of the next epoch, before any checkpoint of this step."""
        state = self.state
        self.phase = "epoch end"
        self.callbacks.call("on_epoch_end", self, state, self.control)
        state.epoch_index += 1
        optim.step_on_epoch_end(self.scheduler, state.epoch_index)  # configure_optimizers' interval="epoch"
        state.batches_in_epoch, state.samples_in_epoch = 0, 0
        state.epoch = float(state.epoch_index)

    def _end_fit(self, run: FitRun) -> None:
        """Training ended (stopped, or no step left): the boundary of the run's end (unless a stop
        set in ``on_save`` made this step's checkpoint the run's last record), the last checkpoint
        committed, the best weights loaded if asked for."""
        self.preemption.finish_vote()
        self.phase = "end of fit"
        eval_mode(self.optimizer)  # the module a fit returns holds a schedule-free optimizer's averaged weights
        state = self.state
        if state.last_save_step != state.global_step:
            self._carry_out(run, BoundaryPlan.end_of_fit(state.global_step, has_eval_sets=bool(run.eval_sets)))
        self._commit()  # an asynchronous write still in flight
        self.phase = "end of fit"
        if self.config.load_best_at_end and state.best_checkpoint:
            self.checkpointer.load_weights(Path(state.best_checkpoint))  # type: ignore[union-attr]

    # ---- set-up ---------------------------------------------------------------------------------
    def _set_up(self, module: TaskModule, train: Any, val: Any, resume: bool | str | None) -> FitRun:
        """Processes and devices, output directory, data, module, optimizer, checkpoint, loggers."""
        cfg = self.config
        self.phase = "set-up"
        strategy = self.setup_strategy()
        # from here a signal (during a checkpoint load, say) waits for the first step boundary; not
        # before: a rank meeting a peer that failed to start must end at the launcher's SIGTERM
        self.preemption.install(cfg.preemption_grace)
        # this fit's callbacks, state and control first: on_exception gets them for any error from
        # here on (set-up errors included), never an earlier fit's
        self.state, self.control = FitState(), Control()
        self.callbacks = CallbackList(built_in_callbacks(cfg, module, strategy.is_global_zero) + self.user_callbacks)
        strategy.precision.reset()  # an earlier fit's loss scale is not this one's
        check_task_module(module)
        # which checkpoint to resume is chosen once, on the main rank, for all
        resume_from = decided_on_main(strategy, resolve_resume, cfg, resume) if resume else None
        self._resume_choice = resume_from
        if resume_from is None:  # a fresh fit must not mix with an old run
            decided_on_main(strategy, prepare_output_dir, cfg.output_dir, cfg.overwrite_output_dir, resume)
        seed_everything(cfg.seed)
        run = self._set_up_data(module, train, val, resume_from)
        self._set_up_model(run)
        if resume_from is not None:
            self.checkpointer.load(resume_from, verified=resume in (True, "auto"))  # type: ignore[union-attr]
            self.resumed_from = str(resume_from)
            run.last_metrics = self.state.last_evaluation()  # what a run that evaluates no more reports
        self.state.max_steps = run.max_steps
        self.loggers = build_loggers(cfg.loggers, cfg.output_dir, enabled=strategy.is_global_zero,
                                     resume_step=self.state.global_step if resume_from else None,
                                     hyperparams=cfg.to_dict(), runs=self.state.tracker_runs)
        if cfg.model_summary and strategy.is_global_zero and resume_from is None:
            log.info("model summary\n%s", model_summary(module))
        if strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(strategy.root_device)
        return run

    def _set_up_data(self, module: TaskModule, train: Any, val: Any, resume_from: Path | None) -> FitRun:
        cfg, strategy = self.config, self.strategy
        assert strategy is not None
        self.train_data = train_data = build_train_data(
            train, batch_size=cfg.batch_size, shuffle=cfg.shuffle, drop_last=cfg.drop_last,
            num_workers=cfg.num_workers, pin_memory=cfg.pin_memory, seed=cfg.seed,
            rank=strategy.global_rank, world_size=strategy.world_size, module=module,
            remove_unused_columns=cfg.remove_unused_columns)
        eval_sets = self._eval_loaders(val, module=module)
        for option in ("eval_every", "eval_on_epoch_end"):
            if getattr(cfg, option) and not eval_sets:
                raise ConfigError(f"{option} is set but fit() got no evaluation data: pass val=..., or drop {option}")
        # lightlike's sampler gives every rank the same batches, and with the default num_items
        # the same counts; otherwise the ranks agree on the epoch's length where it is known (the
        # shortest share's) and on each step that all still have data, and sum their item counts
        agree_on_data = strategy.world_size > 1 and not train_data.deals_evenly
        if agree_on_data:
            train_data.agree_on_length(strategy)
        limit, eval_sets = TrainLimit(cfg, train_data), limited_eval_sets(cfg, eval_sets)  # limit_*_batches
        resumed = saved_fit_state(resume_from, train_data, cfg.resume_data_changed, strategy.global_rank)
        max_steps, epoch_limit = train_data.step_budget(cfg.max_steps, cfg.max_epochs, cfg.grad_accum_steps, resumed)
        check_within_the_run(resumed, max_steps, resume_from, cfg)
        warn_eval_every_past_the_end(cfg, max_steps)
        optim.check_epoch_budget(cfg, max_steps)  # max_epochs=1e18 alone
        losses = LossBuffer(strategy.root_device, raise_nonfinite=cfg.nonfinite_loss == "raise")
        self.module = module
        return FitRun(train_data=train_data,
                   eval_sets=eval_sets, best=BestMetric(cfg, eval_sets), max_steps=max_steps, epoch_limit=epoch_limit,
                   losses=losses, agree_on_data=agree_on_data, resume_from=resume_from, limit=limit)

    def _set_up_model(self, run: FitRun) -> None:
        """The module wrapped by the strategy, its optimizer and scheduler, and the checkpointer
        that holds them (with the callbacks and the loop's state)."""
        cfg, strategy, module = self.config, self.strategy, self.module
        assert strategy is not None
        apply_liger(module, cfg, strategy.root_device.type)  # use_liger_kernel: before the strategy wraps it
        if cfg.gradient_checkpointing:  # the module's own switch (HF's name), which it may override
            module.gradient_checkpointing_enable()
        else:
            module.gradient_checkpointing_disable()
        materialise_lazy_modules(module, run.train_data.loader)  # nn.LazyLinear & co.: shaped before wrapping
        module.zero_grad(set_to_none=True)  # gradients left by an earlier fit that failed, or by the user
        self.neftune = attach_neftune(module, cfg.neftune_noise_alpha, self.neftune)  # off again when fit() ends
        base = BaseFingerprint.of(module)  # of the frozen base a partial module checkpoints without, before sharding
        if manual.is_manual(module):  # several optimizers, stepped by the module (lightlike/manual.py)
            model, pairs = manual.set_up(cfg, module, strategy)
            run.manual = manual.ManualStep(module, module.num_items, pairs)
            optimizer, scheduler = run.manual.optimizers, run.manual.schedulers
        else:
            model = strategy.setup_module(module)
            optimizer, scheduler = optim.build_optimizer_and_scheduler(module, cfg, strategy.precision, run.max_steps)
            model, optimizer = strategy.setup_optimizer(model, optimizer)
            pairs = [(optimizer, scheduler)]
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        compile_run(run, module, cfg)  # compile=True: forward and loss as one compiled function
        self._set_up_step(run, pairs)
        self.resumed_from = None
        self.checkpointer = Checkpointer(cfg, strategy, module=module, model=model, optimizer=optimizer,
                                         scheduler=scheduler, callbacks=self.callbacks,
                                         loop=LoopState(self.state, run.losses, run.train_data), states=self.states,
                                         base=base)

    def _set_up_step(self, run: FitRun, pairs: list[tuple[Any, Any]]) -> None:
        """The training step (the module's own, or the automatic one) and the step context it
        runs on, given what it needs (``lightlike/step.py``)."""
        cfg, strategy, module = self.config, self.strategy, self.module
        if run.manual is not None:
            run.training_step = run.manual
        else:  # lightlike's sampler deals every rank the same integer counts (with the default num_items)
            default_counts = type(module).num_items is TaskModule.num_items and "num_items" not in vars(module)
            run.training_step = AutomaticStep(module, run.forward_loss, module.num_items,
                                              uniform_counts=run.train_data.deals_evenly and default_counts)
        check = NonFiniteCheck(cfg.nonfinite_loss, strategy.collectives, strategy.root_device, self.state)
        context = StepContext if run.manual is None else ManualStepContext
        run.ctx = context(strategy=strategy, model=self.model, pairs=pairs, check=check, losses=run.losses,
                          before_update=self.callbacks.hook("on_before_optimizer_step", self), max_norm=cfg.max_grad_norm,
                          max_value=cfg.max_grad_value, log_every=cfg.log_every, max_steps=run.max_steps)

    def setup_strategy(self) -> Strategy:
        """The strategy named by the config, its processes and devices set up (once)."""
        if self.strategy is None:
            cfg = self.config
            precision = None if cfg.precision == "auto" else get_precision(cfg.precision)
            strategy = get_strategy(cfg.strategy, cfg.accelerator, precision)
            strategy.configure(cfg)
            strategy.setup_environment()
            setup_logging(cfg.log_level, strategy.is_global_zero, cfg.log_level_other_ranks)
            self.strategy = strategy
        return self.strategy

    def _eval_loaders(self, data: Any, default_name: str = "val", module: Any = None) -> dict[str, Any]:
        cfg, strategy, module = self.config, self.strategy, module if module is not None else self.module
        assert strategy is not None
        return {
            name: build_eval_loader(d, batch_size=cfg.eval_batch_size or cfg.batch_size,
                                    num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
                                    rank=strategy.global_rank, world_size=strategy.world_size, name=name,
                                    module=module, remove_unused_columns=cfg.remove_unused_columns)
            for name, d in normalise_eval_sets(data, default_name).items()
        }

    # ---- logging, evaluation and checkpoints during fit -----------------------------------------
    def _log_training(self, run: FitRun, final: bool = False) -> None:
        """Log the losses pending since the last row (with ``final``: only if there are any)."""
        if final and not run.losses.pending:
            return
        loss_sum, item_sum = run.losses.pop_for_row(self.strategy)
        state = self.state
        state.items_seen += item_sum
        metrics: dict[str, float] = {
            "train/loss": loss_sum / item_sum if item_sum else float("nan"),
            "train/epoch": round(state.epoch, 4),
        }
        lr = self.scheduler.get_last_lr()[0] if self.scheduler is not None else self.optimizer.param_groups[0]["lr"]
        metrics["train/lr"] = float(lr)
        metrics.update(run.manual.take_logged(self.strategy) if run.manual is not None else {})  # train/<key>
        if run.grad_norm is not None:
            metrics["train/grad_norm"] = float(run.grad_norm)
            run.grad_norm = None
        if state.skipped_steps:
            metrics["train/skipped_steps"] = float(state.skipped_steps)
        self._emit(run, "on_log", metrics)

    def _emit(self, run: FitRun, event: str, metrics: dict[str, float]) -> None:
        state = self.state
        state.log_history.append({"step": state.global_step, **metrics})
        if not run.bar_active and log.isEnabledFor(logging.INFO):  # no bar (not a terminal): a log line
            log.info("step %d/%d  %s", state.global_step, state.max_steps,
                     "  ".join(f"{k}={v:.5g}" for k, v in metrics.items()))
        for lg in self.loggers:
            lg.log_metrics(metrics, state.global_step)
        self.callbacks.call(event, self, state, self.control, metrics)

    def _evaluate_all(self, run: FitRun) -> dict[str, float]:
        """Evaluate every set; update the best metric; tell loggers and callbacks."""
        if not run.eval_sets:
            raise ConfigError("control.should_evaluate was set (by a callback) but fit() got no evaluation data: "
                              "pass val= to fit(), or do not set the flag")
        self.phase = "evaluation"
        run.losses.read_checked()  # raises now if a pending loss is non-finite
        eval_mode(self.optimizer)  # a schedule-free optimizer's averaged weights (train mode: the next step)
        metrics: dict[str, float] = {}
        # training's random streams continue as if no evaluation ran (a user's DataLoader draws
        # its workers' base seed from the global generator; the module or a dataset may sample)
        with rng_kept():
            for name, loader, limit in eval_limits(self.config, run.eval_sets):
                m, _, _ = run_evaluation(self.model, self.module, loader, self.strategy, name,
                                         streaming=self.config.eval_streaming, compiled=run.compiled,
                                         include=self.config.include_for_metrics, limit=limit,
                                         on_batch=self.callbacks.hook("on_eval_batch_end", self))  # a bar
                metrics.update(m)
        state = self.state
        state.last_eval_step = state.global_step
        run.best.update(metrics, state)
        optim.step_on_evaluation(self.scheduler, metrics)  # reduce_lr_on_plateau: after each evaluation
        self._emit(run, "on_evaluate", metrics)
        run.last_metrics = metrics
        return metrics

    def _save(self, wait: bool = True, full: bool | None = None) -> Path | None:
        """Save at this step boundary. ``wait=False`` lets a strategy that writes asynchronously
        return before its files are on disk; the checkpoint is committed by the next save or at
        the end of the fit."""
        checkpointer = self.checkpointer
        assert checkpointer is not None
        self._commit()
        self.control.should_save = False
        self.phase = "checkpoint save"
        checkpointer.loop.losses.read_checked()  # raises now if a pending loss is non-finite
        for lg in self.loggers:  # what was logged up to this checkpoint reaches the disk first
            lg.flush()
        eval_mode(self.optimizer)
        path = checkpointer.save(wait=wait, full=full)
        if path is not None:
            self.callbacks.call_on_save(self, self.state, self.control, str(path))
        return path

    def _commit(self) -> None:
        """Finish and commit an asynchronous checkpoint write, if one is in flight."""
        if self.checkpointer is None or self.checkpointer.in_flight is None:
            return
        self.phase = "checkpoint save"
        path = self.checkpointer.commit()
        if path is not None:
            self.callbacks.call_on_save(self, self.state, self.control, str(path))

    # ==== evaluation and prediction outside fit ===================================================
    def validate(self, module: TaskModule, data: Any) -> dict[str, float]:
        """Evaluate on ``data`` (or a dict of sets); keys ``val/<name>`` (or ``<set>/<name>``)."""
        with guarded(self), rng_kept():  # as in fit: the caller's random streams go on untouched
            return self._evaluate_standalone(module, data, "val")

    def test(self, module: TaskModule, data: Any) -> dict[str, float]:
        """Like ``validate`` with keys ``test/<name>``."""
        with guarded(self), rng_kept():
            return self._evaluate_standalone(module, data, "test")

    def predict(self, module: TaskModule, data: Any) -> PredictionResult:
        """Predictions (``TaskModule.predictions``) in dataset order, labels if the batches carry
        them, and the metrics over the whole set (keys ``predict/<name>``)."""
        with guarded(self), rng_kept():
            self.phase = "prediction"
            strategy = self.setup_strategy()
            model = self._prepare_for_eval(module)
            loader = self._eval_loaders(data, default_name="predict")["predict"]
            metrics, preds, labels = run_evaluation(model, module, loader, strategy, "predict",
                                                    streaming=self.config.eval_streaming, keep_outputs=True,
                                                    include=self.config.include_for_metrics)
            return PredictionResult(preds, labels, metrics)

    def search(self, module_factory: Any, space: Any, n_trials: int, **options: Any) -> Any:
        """Optuna search: a fresh fit per trial in ``output_dir/trial-<n>``; see ``lightlike.search``."""
        from lightlike.search import search  # (optuna's own import is in there)

        self.phase = "search"
        with failing_fast(self):  # a trial's failure on one rank ends every rank's search
            return search(self, module_factory, space, n_trials, **options)

    def _evaluate_standalone(self, module: TaskModule, data: Any, default_name: str) -> dict[str, float]:
        self.phase = "evaluation"
        strategy = self.setup_strategy()
        model = self._prepare_for_eval(module)
        metrics: dict[str, float] = {}
        loaders = self._eval_loaders(data, default_name=default_name)
        for name, loader, limit in eval_limits(self.config, loaders, limited=default_name == "val"):
            m, _, _ = run_evaluation(model, module, loader, strategy, name, streaming=self.config.eval_streaming,
                                     include=self.config.include_for_metrics, limit=limit)
            metrics.update(m)
        return metrics

    def _prepare_for_eval(self, module: TaskModule) -> Any:
        check_task_module(module)
        if self.module is module and self.model is not None:
            return self.model
        self.module = module
        self.model = self.strategy.setup_module_for_evaluation(module)  # type: ignore[union-attr]
        return self.model

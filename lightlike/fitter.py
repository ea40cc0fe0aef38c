"""``Fitter``: the training loop, written out in one readable place.

``fit`` reads like a hand-written loop: set up, then for each epoch, for each optimizer step,
take the step's micro-batches (the accumulation window), forward/backward each with weight
``items_i / items_in_step``, clip, step, then log / evaluate / save when due. Distribution is
the ``Strategy``'s business and numerics the ``Precision`` plugin's; the loop only calls them.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from lightlike.callbacks.base import Callback, CallbackList
from lightlike.config import FitConfig, check_keys
from lightlike.data.eval_loading import build_eval_loader, normalise_eval_sets
from lightlike.data.loading import TrainData, build_train_data
from lightlike.errors import ConfigError, DataError
from lightlike.evaluation import forward_loss, greater_is_better, is_improvement, run_evaluation
from lightlike.module import TaskModule, batch_length, check_task_module
from lightlike.pending import item_weight, read_pending, sum_pending
from lightlike.precision import get_precision
from lightlike.preemption import PreemptionHandler, save_and_exit
from lightlike.state import Control, FitResult, FitState, PredictionResult
from lightlike.strategies import Strategy, get_strategy
from lightlike.utils.buffers import restore_buffers, snapshot_buffers
from lightlike.utils.failfast import decided_on_main, failing_fast, guarded
from lightlike.utils.memory import peak_memory_bytes
from lightlike.utils.seed import rng_kept, seed_everything

log = logging.getLogger("lightlike")


class Fitter:
    """Trains, evaluates and predicts with a ``TaskModule``.

    Every keyword is a ``FitConfig`` field (``Fitter(config=cfg, max_steps=10)`` overrides a
    field of ``cfg``). ``callbacks`` is a list of ``Callback`` objects.
    """

    def __init__(self, config: FitConfig | None = None, *, callbacks: list[Callback] | None = None, **kwargs: Any):
        check_keys(kwargs, FitConfig)
        self.config = config.replace(**kwargs) if config is not None else FitConfig(**kwargs)
        self.user_callbacks = list(callbacks or [])
        # seeded here too (as the HF Trainer does), so a module built after the Fitter, as in
        # `Fitter(seed=0).fit(Model(), ...)`, starts from the same weights every run
        seed_everything(self.config.seed)  # (deterministic algorithms: during fit/validate/... only)
        self.strategy: Strategy | None = None
        self.module: TaskModule | None = None  # the user's module
        self.model: Any = None  # what the loop calls: the module as wrapped by the strategy
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.state = FitState()
        self.control = Control()
        self.loggers: list[Any] = []
        self.callbacks = CallbackList([])
        self.train_data: TrainData | None = None
        self.resumed_from: str | None = None
        self._phase = "set-up"
        self._bar_active = False
        # (loss, items, step, micro-batch) of every micro-batch not yet logged; losses stay on the
        # device until a log step reads them all at once
        self._pending: list[tuple[torch.Tensor, int | torch.Tensor, int, int]] = []
        self._loss_total, self._items_total = 0.0, 0.0
        self._checkpoint_in_flight: Any = None  # an asynchronous save not yet committed

    def init_module(self) -> Any:
        """Context in which to build a module too large for one device: ``with
        fitter.init_module(): module = Model()``. The strategy decides (FSDP: on the meta device,
        materialised shard by shard in ``fit``; DeepSpeed ZeRO-3: partitioned as it is built;
        others: as usual). Sets up the process group first."""
        return self._setup_strategy().module_init_context()

    # ==== fit =====================================================================================
    def fit(self, module: TaskModule, train: Any, val: Any = None, *, resume: bool | str | None = None) -> FitResult:
        """Train ``module`` on ``train``; evaluate on ``val`` (a Dataset/DataLoader or a dict of
        them). ``resume=True`` continues from the newest valid checkpoint in ``output_dir``,
        ``resume="path"`` from that checkpoint."""
        self.config.need_stopping_criterion()
        self._preemption = PreemptionHandler(self.config.preemption_signals)  # one per fit(): kept over retries
        try:
            with guarded(self):
                if not self.config.auto_find_batch_size:
                    return self._fit(module, train, val, resume)
                from lightlike.utils.oom import fit_finding_batch_size

                return fit_finding_batch_size(self, module, train, val, resume)
        finally:
            self._preemption.uninstall()

    def _fit(self, module: TaskModule, train: Any, val: Any, resume: bool | str | None) -> FitResult:
        cfg = self.config
        self._phase = "set-up"
        # ---- set up: processes and devices, output dir, data, module, optimizer ----------------
        strategy = self._setup_strategy()
        # from here a signal (during a checkpoint load, say) waits for the first step boundary; not
        # before: a rank meeting a peer that failed to start must end at the launcher's SIGTERM
        self._preemption.install()
        # this fit's callbacks, state and control first: on_exception gets them for any error from
        # here on (set-up errors included), never an earlier fit's
        self.state, self.control = FitState(), Control()
        from lightlike.callbacks.checks import built_in_callbacks
        from lightlike.callbacks.progress import ProgressBar

        built_in = built_in_callbacks(cfg, module, strategy.is_global_zero)
        bars = [cb for cb in built_in if isinstance(cb, ProgressBar)]
        self.callbacks = callbacks = CallbackList(built_in + self.user_callbacks)
        strategy.precision.reset()  # an earlier fit's loss scale is not this one's
        check_task_module(module)
        from lightlike.checkpoint.resume import resolve_resume  # chosen once, on the main rank, for all

        resume_from = decided_on_main(strategy, resolve_resume, cfg, resume) if resume else None
        self._resume_choice = resume_from  # an out-of-memory retry starts from the same place
        if resume_from is None:  # a fresh fit must not mix with an old run
            from lightlike.checkpoint.rotation import prepare_output_dir

            decided_on_main(strategy, prepare_output_dir, cfg.output_dir, cfg.overwrite_output_dir, resume)
        seed_everything(cfg.seed)
        self.train_data = train_data = build_train_data(
            train, batch_size=cfg.batch_size, shuffle=cfg.shuffle, drop_last=cfg.drop_last,
            num_workers=cfg.num_workers, pin_memory=cfg.pin_memory, seed=cfg.seed,
            rank=strategy.global_rank, world_size=strategy.world_size)
        eval_sets = self._eval_loaders(val)
        for option in ("eval_every", "eval_on_epoch_end"):
            if getattr(cfg, option) and not eval_sets:
                raise ConfigError(f"{option} is set but fit() got no evaluation data: pass val=..., or drop {option}")
        if cfg.metric_for_best and not eval_sets:
            raise ConfigError(f"metric_for_best={cfg.metric_for_best!r} needs evaluation data: pass val=...")
        accum = cfg.grad_accum_steps
        # lightlike's sampler gives every rank the same batches, and with the default num_items
        # the same counts; otherwise the ranks agree on the epoch's length where it is known (the
        # shortest share's) and each step that all still have data, and sum their item counts
        agree_on_data = strategy.world_size > 1 and not train_data.deals_evenly
        if agree_on_data:
            train_data.agree_on_length(strategy)
        resumed = FitState.saved_in(resume_from) if resume_from is not None else None
        max_steps, epoch_limit = train_data.step_budget(cfg.max_steps, cfg.max_epochs, accum, resumed)

        module.gradient_checkpointing = cfg.gradient_checkpointing
        self.module = module
        module.zero_grad(set_to_none=True)  # gradients left by an earlier fit that failed, or by the user
        model = strategy.setup_module(module)
        optimizer, scheduler = self._configure_optimizers(module, max_steps)
        model, optimizer = strategy.setup_optimizer(model, optimizer)
        if cfg.compile:
            model = torch.compile(model)  # type: ignore[assignment]
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._step_parts = (strategy, module, model, optimizer)
        self._pending = []
        self._checkpoint_in_flight = None
        self._loss_total, self._items_total = 0.0, 0.0
        self.resumed_from = None
        if resume_from is not None:
            from lightlike.checkpoint.training import load_training_checkpoint

            load_training_checkpoint(self, resume_from, verified=resume in (True, "auto"))  # chosen by verifying
        state, control = self.state, self.control
        state.max_steps = max_steps
        from lightlike.loggers import build_loggers

        self.loggers = build_loggers(cfg.loggers, cfg.output_dir, enabled=strategy.is_global_zero,
                                     resume_step=state.global_step if resume_from else None, hyperparams=cfg.to_dict())
        if cfg.model_summary and strategy.is_global_zero and resume_from is None:
            from lightlike.loggers.summary import model_summary

            log.info("model summary\n%s", model_summary(module))

        self._grad_norm: torch.Tensor | None = None
        self._last_metrics: dict[str, float] = state.last_evaluation()  # resumed: its last evaluation's
        start_time, start_step, start_samples = time.perf_counter(), state.global_step, state.samples_seen
        if strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(strategy.root_device)

        default_counts = type(module).num_items is TaskModule.num_items and "num_items" not in vars(module)
        self._uniform_counts = train_data.deals_evenly and default_counts
        self._count_items = batch_length if default_counts else module.num_items  # (what num_items calls)
        step_start, step_end = callbacks.handlers("on_step_start"), callbacks.handlers("on_step_end")
        self._before_optimizer_step = callbacks.handlers("on_before_optimizer_step")
        preemption = self._preemption  # installed by fit(); an out-of-memory retry keeps what it received
        preemption.vote = None
        self._stop_agreed: Any = None  # no stop flag is agreed per step: the preemption vote decides (several ranks)
        world_size, log_every = strategy.world_size, cfg.log_every
        try:
            callbacks.call("on_fit_start", self, state, control)
            self._bar_active = any(bar.bar is not None for bar in bars)  # a bar drawn replaces log lines
            model.train()
            epoch = state.epoch_index
            next_due = self._next_due(state.global_step, max_steps)
            # ---- the loop ----------------------------------------------------------------------
            while state.global_step < max_steps and not control.should_training_stop and epoch < epoch_limit:
                batches = train_data.epoch_iterator(epoch, state.samples_in_epoch, state.batches_in_epoch)
                position = train_data.position(state.samples_in_epoch, state.batches_in_epoch, strategy.world_size)
                batches = position.watch(batches)  # read one batch ahead where the epoch's length is unknown
                if state.batches_in_epoch == 0:
                    callbacks.call("on_epoch_start", self, state, control)
                while state.global_step < max_steps:
                    self._phase = "train step"
                    window = list(itertools.islice(batches, accum))  # this step's micro-batches
                    if agree_on_data and not position.follows and strategy.collectives.reduce_flag(not window) and window:
                        log.warning("another rank ran out of training data: skipping this rank's last "
                                    "%d batch(es) of epoch %d", len(window), epoch)
                        window = []
                    if not window:  # the epoch ran out (its length was not known, or drop_last)
                        if state.batches_in_epoch == 0:
                            raise DataError(f"epoch {epoch} of the training data produced no batch")
                        epoch = self._end_epoch(epoch, eval_sets)
                        last = control.should_training_stop or epoch >= epoch_limit
                        if last:  # what is pending is logged and evaluated before the checkpoint
                            self._finish_step(eval_sets)
                        if self._save_due(epoch_ended=True, final=last):
                            self._save_checkpoint(wait=False)
                        break
                    for handler in step_start:  # the callbacks' on_step_start (usually none)
                        handler(self, state, control)
                    step = state.global_step + 1  # the norm is logged at log steps and the last one
                    log_step = step % log_every == 0
                    stepped = self._training_step(window, want_norm=log_step or step >= max_steps)
                    if stepped and scheduler is not None:
                        scheduler.step()
                    state.global_step += 1
                    self._phase = "step end"
                    state.batches_in_epoch += len(window)
                    in_epoch, fraction, epoch_done = position.advance(len(window))
                    state.samples_seen += in_epoch - state.samples_in_epoch
                    state.samples_in_epoch = in_epoch
                    state.epoch = epoch + fraction
                    for handler in step_end:
                        handler(self, state, control)

                    # ---- the step boundary: log, evaluate, end the epoch, then save ---------------
                    # (a checkpoint taken here holds everything done at this step, so a resumed
                    # run repeats none of it: no log line, evaluation or epoch end twice)
                    # (flags set in on_log / on_evaluate / on_epoch_end count at this step)
                    # (most steps have nothing due: no scheduled log, evaluation or save, no epoch
                    # end, no flag set and no stop to agree on; one test skips the rest for them)
                    if step < next_due and not epoch_done and not control.pending() \
                            and not preemption.may_stop(world_size, step, self._stop_agreed):
                        continue
                    epoch_ended = epoch_done or control.should_epoch_stop
                    last = step >= max_steps or control.should_training_stop or (epoch_ended and epoch + 1 >= epoch_limit)
                    if control.should_log or log_step or last:
                        self._log_training()
                        epoch_ended = epoch_ended or control.should_epoch_stop
                        last = last or control.should_training_stop or (epoch_ended and epoch + 1 >= epoch_limit)
                    if control.should_evaluate or (cfg.eval_every and step % cfg.eval_every == 0) \
                            or (last and eval_sets and state.last_eval_step != step):
                        self._evaluate_all(eval_sets)
                        epoch_ended = epoch_ended or control.should_epoch_stop
                    if epoch_ended:
                        epoch = self._end_epoch(epoch, eval_sets)
                    if not last and (control.should_training_stop or epoch >= epoch_limit):
                        last = True  # stopped by an evaluation or an epoch end: what is pending is
                        self._finish_step(eval_sets)  # logged and evaluated before this step's checkpoint
                    if self._save_due(epoch_ended, final=last):
                        self._save_checkpoint(wait=False)
                    if preemption.stop_requested(strategy, step, self._stop_agreed, log_step):
                        if last or control.should_training_stop:  # it ends here anyway: no preemption
                            log.warning("%s received at the run's last step %d: it ends normally (no requeue)",
                                        preemption.signal_name or "a signal", step)
                        else:
                            save_and_exit(self, preemption.signal_name or "a signal on another rank")
                    next_due = self._next_due(step, max_steps)
                    if control.should_training_stop or epoch_ended:
                        break
            # ---- end of training (stopped by a callback, or no step left to take) ----------------
            self._preemption.finish_vote()
            self._phase = "end of fit"
            if state.last_save_step != state.global_step:  # a stop set in on_save: the step's checkpoint
                self._finish_step(eval_sets)  # is the run's last record, so nothing is logged after it
            if self._save_due(final=True):
                self._save_checkpoint()
            self._commit_checkpoint()  # an asynchronous write still in flight
            self._phase = "end of fit"
            if cfg.load_best_at_end and state.best_checkpoint:
                from lightlike.checkpoint.training import load_weights_from

                load_weights_from(self, Path(state.best_checkpoint))
            callbacks.call("on_fit_end", self, state, control)
        finally:
            for lg in self.loggers:
                lg.finalize()

        runtime = time.perf_counter() - start_time
        steps = state.global_step - start_step
        loss_total, items_total = self._loss_total, self._items_total
        if self._pending:  # left pending in the last checkpoint by a stop set in on_save: counted, not logged
            more = sum_pending(self.strategy, self._read_pending())
            loss_total, items_total = loss_total + more[0], items_total + more[1]
        training_loss = loss_total / items_total if items_total else float("nan")
        metrics = {**self._last_metrics, "train/loss": training_loss}
        return FitResult(
            global_step=state.global_step,
            training_loss=training_loss,
            metrics=metrics,
            runtime=runtime,
            samples_per_second=(state.samples_seen - start_samples) / runtime if runtime else 0.0,
            steps_per_second=steps / runtime if runtime else 0.0,
            peak_memory_bytes=peak_memory_bytes(strategy.root_device),
            skipped_steps=state.skipped_steps,
            best_checkpoint=state.best_checkpoint,
            state=state,
        )

    # ------------------------------------------------------------------------------------------
    def _training_step(self, window: list[Any], want_norm: bool) -> bool:
        """Forward/backward every micro-batch of one optimizer step, then clip and step.

        Micro-batch i is weighted by ``items_i / items_in_step``, so the step's gradient is the
        gradient of the mean loss over every item in the step, whatever each micro-batch holds.
        Returns whether the optimizer update was applied."""
        cfg = self.config
        strategy, module, model, optimizer = self._step_parts  # (set up by fit)
        batches = list(map(strategy.batch_to_device, window))
        counts = list(map(self._count_items, batches))
        normaliser = strategy.item_normaliser(counts, uniform=self._uniform_counts)
        last = len(batches) - 1
        step = self.state.global_step + 1
        skip_nonfinite = cfg.nonfinite_loss == "skip"
        buffers = snapshot_buffers(module) if skip_nonfinite else None  # BatchNorm statistics
        for i, batch in enumerate(batches):
            with strategy.no_sync(model, enabled=i < last):
                with strategy.autocast():
                    loss = forward_loss(model, module, batch, "at step {}, micro-batch {}", step, i)
                n, total = counts[i], normaliser.total
                if type(n) is int and type(total) is int and n == total and n:  # every item of the step:
                    strategy.backward(loss, model)  # weight 1, no extra op
                else:
                    strategy.backward(loss * item_weight(n, total, loss.dtype), model)
            self._pending.append((loss.detach(), n, step, i))
        self._stop_agreed = None  # (no stop flag agreed in the step: the every-10-steps vote decides)
        if skip_nonfinite:
            window_losses = torch.stack([p[0] for p in self._pending[-len(batches):]])
            # one host read per step, by choice; every rank skips if any rank saw a non-finite loss
            if strategy.collectives.reduce_flag(not bool(torch.isfinite(window_losses).all())):
                optimizer.zero_grad(set_to_none=True)
                restore_buffers(buffers)  # type: ignore[arg-type]
                self._grad_norm = None
                del self._pending[-len(batches):]
                self.state.skipped_steps += 1
                log.warning("non-finite loss at step %d: step skipped (%d skipped so far)", step,
                            self.state.skipped_steps)
                return False
        # this step's norm, or None (a step that logs no norm, or is skipped, shows none)
        self._grad_norm = strategy.clip_gradients(model, optimizer, cfg.max_grad_norm, cfg.max_grad_value, want_norm)
        for handler in self._before_optimizer_step:
            handler(self, self.state, self.control, optimizer)
        stepped = strategy.optimizer_step(optimizer, model)
        optimizer.zero_grad(set_to_none=True)
        if not stepped:
            self.state.skipped_steps += 1
        return stepped

    # ------------------------------------------------------------------------------------------
    def _read_pending(self) -> list[tuple[float, float, int, int]]:
        """This rank's pending (loss, items, step, micro-batch) values, on the host (``read_pending``)."""
        return read_pending(self._pending, self.strategy.root_device,  # type: ignore[union-attr]
                            raise_nonfinite=self.config.nonfinite_loss == "raise")

    def _finish_step(self, eval_sets: dict[str, Any]) -> None:
        """Before this step's last checkpoint: log what is pending and evaluate the step, unless
        done already."""
        self._log_training(final=True)
        if eval_sets and self.state.last_eval_step != self.state.global_step:
            self._evaluate_all(eval_sets)

    def _log_training(self, final: bool = False) -> None:
        """Log the losses pending since the last row (with ``final``: only if there are any)."""
        self.control.should_log = False
        values = self._read_pending()
        self._pending = []
        if not values and final:
            return
        loss_sum, item_sum = sum_pending(self.strategy, values)
        self._loss_total += loss_sum
        self._items_total += item_sum
        state = self.state
        state.items_seen += item_sum
        metrics: dict[str, float] = {
            "train/loss": loss_sum / item_sum if item_sum else float("nan"),
            "train/epoch": round(state.epoch, 4),
        }
        if self.scheduler is not None:
            metrics["train/lr"] = float(self.scheduler.get_last_lr()[0])
        else:
            metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
        if self._grad_norm is not None:
            metrics["train/grad_norm"] = float(self._grad_norm)
            self._grad_norm = None
        if state.skipped_steps:
            metrics["train/skipped_steps"] = float(state.skipped_steps)
        self._emit("on_log", metrics)
        self.control.should_log = False  # asked for again in on_log: this row is the one

    def _emit(self, event: str, metrics: dict[str, float]) -> None:
        state = self.state
        state.log_history.append({"step": state.global_step, **metrics})
        if not self._bar_active and log.isEnabledFor(logging.INFO):  # no bar (not a terminal): a log line
            log.info("step %d/%d  %s", state.global_step, state.max_steps,
                     "  ".join(f"{k}={v:.5g}" for k, v in metrics.items()))
        for lg in self.loggers:
            lg.log_metrics(metrics, state.global_step)
        self.callbacks.call(event, self, state, self.control, metrics)

    def _evaluate_all(self, eval_sets: dict[str, Any]) -> dict[str, float]:
        """Evaluate every set; update the best metric; tell loggers and callbacks. A training
        row asked for in ``on_evaluate`` is written at this step too."""
        self.control.should_evaluate = False
        if not eval_sets:
            raise ConfigError("control.should_evaluate was set (by a callback) but fit() got no evaluation data: "
                              "pass val= to fit(), or do not set the flag")
        self._phase = "evaluation"
        self._read_pending()  # raises now if a pending loss is non-finite
        metrics: dict[str, float] = {}
        # training's random streams continue as if no evaluation ran (a user's DataLoader draws
        # its workers' base seed from the global generator; the module or a dataset may sample)
        with rng_kept():
            for name, loader in eval_sets.items():
                m, _, _ = run_evaluation(self.model, self.module, loader, self.strategy, name,  # type: ignore[arg-type]
                                         streaming=self.config.eval_streaming)
                metrics.update(m)
        state, cfg = self.state, self.config
        state.last_eval_step = state.global_step
        key = cfg.metric_for_best
        if key is not None:
            if key not in metrics:
                raise ConfigError(f"metric_for_best={key!r} is not among the evaluation metrics {sorted(metrics)}")
            if is_improvement(metrics[key], state.best_metric, greater_is_better(key, cfg.greater_is_better)):
                state.best_metric, state.best_step = metrics[key], state.global_step
        self._emit("on_evaluate", metrics)
        self._last_metrics = metrics
        if self.control.should_log:
            self._log_training(final=True)
        self.control.should_evaluate = False  # asked for again in on_evaluate or its row: once per step
        return metrics

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
            return self._predict(module, data)

    def _predict(self, module: TaskModule, data: Any) -> PredictionResult:
        self._phase = "prediction"
        strategy = self._setup_strategy()
        model = self._prepare_for_eval(module)
        loader = self._eval_loaders(data, default_name="predict")["predict"]
        metrics, preds, labels = run_evaluation(model, module, loader, strategy, "predict",
                                                streaming=self.config.eval_streaming, keep_outputs=True)
        return PredictionResult(preds, labels, metrics)

    def search(self, module_factory: Any, space: Any, n_trials: int, **options: Any) -> Any:
        """Optuna search: a fresh fit per trial in ``output_dir/trial-<n>``; see ``lightlike.search``."""
        from lightlike.search import search

        self._phase = "search"
        with failing_fast(self):  # a trial's failure on one rank ends every rank's search
            return search(self, module_factory, space, n_trials, **options)

    def _evaluate_standalone(self, module: TaskModule, data: Any, default_name: str) -> dict[str, float]:
        self._phase = "evaluation"
        strategy = self._setup_strategy()
        model = self._prepare_for_eval(module)
        metrics: dict[str, float] = {}
        for name, loader in self._eval_loaders(data, default_name=default_name).items():
            m, _, _ = run_evaluation(model, module, loader, strategy, name, streaming=self.config.eval_streaming)
            metrics.update(m)
        return metrics

    def _prepare_for_eval(self, module: TaskModule) -> Any:
        check_task_module(module)
        if self.module is module and self.model is not None:
            return self.model
        self.module = module
        self.model = self.strategy.setup_module_for_evaluation(module)  # type: ignore[union-attr]
        return self.model

    # ==== set-up helpers ==========================================================================
    def _setup_strategy(self) -> Strategy:
        if self.strategy is None:
            cfg = self.config
            precision = None if cfg.precision == "auto" else get_precision(cfg.precision)
            strategy = get_strategy(cfg.strategy, cfg.accelerator, precision)
            strategy.configure(cfg)
            strategy.setup_environment()
            from lightlike.loggers.console import setup_logging

            setup_logging(cfg.log_level, strategy.is_global_zero, cfg.log_level_other_ranks)
            self.strategy = strategy
        return self.strategy

    def _eval_loaders(self, data: Any, default_name: str = "val") -> dict[str, Any]:
        cfg, strategy = self.config, self.strategy
        assert strategy is not None
        return {
            name: build_eval_loader(d, batch_size=cfg.eval_batch_size or cfg.batch_size,
                                    num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
                                    rank=strategy.global_rank, world_size=strategy.world_size, name=name)
            for name, d in normalise_eval_sets(data, default_name).items()
        }

    def _configure_optimizers(self, module: TaskModule, max_steps: int) -> tuple[Any, Any]:
        from lightlike import optim

        custom = optim.call_configure_optimizers(module, self.config)
        if custom is not None:
            return optim.unwrap_configure_optimizers(custom)
        optimizer = optim.build_optimizer(module, self.config, self.strategy.precision)  # type: ignore[union-attr]
        return optimizer, optim.build_scheduler(optimizer, self.config, max_steps)

    # -- when to log and save -------------------------------------------------------------------
    def _next_due(self, step: int, max_steps: int) -> int:
        """The first step after ``step`` at which a log, an evaluation or a save is due on
        schedule (``log_every``, ``eval_every``, ``save_every``), or the last step."""
        cfg = self.config
        every = (cfg.log_every, cfg.eval_every, cfg.save_every if cfg.save_strategy == "steps" else None)
        return min([max_steps, *((step // n + 1) * n for n in every if n)])

    def _is_save_step(self, step: int) -> bool:
        cfg = self.config
        return cfg.save_strategy == "steps" and cfg.save_every is not None and step % cfg.save_every == 0

    def _save_due(self, epoch_ended: bool = False, final: bool = False) -> bool:
        """Whether to save at this step boundary: asked by a callback, or due by ``save_strategy``
        (every ``save_every`` steps, at an epoch's end, at a new best, at the end); never twice."""
        cfg, state, control = self.config, self.state, self.control
        step = state.global_step
        if state.last_save_step == step:
            control.should_save = False
            return False
        return (control.should_save or self._is_save_step(step)
                or (cfg.save_strategy == "epoch" and epoch_ended)
                or (cfg.save_strategy == "best" and state.best_step == step)
                or (final and cfg.save_strategy == "steps" and cfg.save_every is not None)
                or (final and cfg.load_best_at_end and state.best_step == step))  # the best must be loadable

    def _end_epoch(self, epoch: int, eval_sets: dict[str, Any]) -> int:
        """End ``epoch`` at this step boundary: callbacks (their flags are acted on here), the
        end-of-epoch evaluation, and the data position moves to the start of the next epoch,
        before any checkpoint of this step is written. Returns the next epoch."""
        cfg, state, control = self.config, self.state, self.control
        self._phase = "epoch end"
        self.callbacks.call("on_epoch_end", self, state, control)
        if control.should_log:
            self._log_training(final=True)  # nothing new since this step's log: no row
        if (control.should_evaluate or (cfg.eval_on_epoch_end and eval_sets)) and state.last_eval_step != state.global_step:
            self._evaluate_all(eval_sets)  # once per step, however many reasons there are
        # spent: this epoch is ending, and evaluated (a flag set in on_epoch_end or the end's row or evaluation)
        control.should_epoch_stop = control.should_evaluate = False
        epoch += 1
        state.epoch_index, state.batches_in_epoch, state.samples_in_epoch = epoch, 0, 0
        state.epoch = float(epoch)
        return epoch

    # -- checkpoints (lightlike/checkpoint/training.py does the work) ---------------------------------
    def _save_checkpoint(self, wait: bool = True, full: bool | None = None) -> Path | None:
        """Save at this step boundary. ``wait=False`` lets a strategy that writes asynchronously
        return before its shards are on disk; the checkpoint is committed by the next save or at
        the end of the fit (``_commit_checkpoint``)."""
        from lightlike.checkpoint.training import save_training_checkpoint

        self._commit_checkpoint()
        self.control.should_save = False
        self._phase = "checkpoint save"
        self._read_pending()  # raises now if a pending loss is non-finite
        for lg in self.loggers:  # what was logged up to this checkpoint reaches the disk first
            lg.flush()
        path = save_training_checkpoint(self, wait=wait, full=full)
        if path is not None:
            self.callbacks.call_on_save(self, self.state, self.control, str(path))
        return path

    def _commit_checkpoint(self) -> None:
        """Finish and commit an asynchronous checkpoint write, if one is in flight."""
        if self._checkpoint_in_flight is None:
            return
        from lightlike.checkpoint.training import commit_pending_checkpoint

        self._phase = "checkpoint save"
        path = commit_pending_checkpoint(self)
        if path is not None:
            self.callbacks.call_on_save(self, self.state, self.control, str(path))


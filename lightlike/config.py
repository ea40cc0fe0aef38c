"""The one configuration dataclass behind every ``Fitter`` keyword.

``FitConfig`` is the single source of truth: the ``Fitter`` keywords, JSON/TOML files and
(later) command-line flags all go through it. Unknown keys are rejected with the closest valid
names, and every field carries its help text in ``metadata["help"]``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lightlike.config_text import OTHER_NAMES, other_name_hint, plain_value, read_if_path, toml_value
from lightlike.errors import ConfigError

__all__ = ["FitConfig", "OTHER_NAMES", "other_name_hint", "plain_value", "toml_value", "field_defaults", "check_keys"]

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "cosine_with_min_lr",
    "wsd",
    "warmup_stable_decay",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
)
#: the built-in optimizers (lightlike.optimizers maps each to its class): torch.optim's, with the
#: HF Trainer's names for AdamW, then other libraries' by the Trainer's names (optional extras)
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "rmsprop", "adagrad", "nadam", "radam", "adamw_torch",
              "adamw_torch_fused", "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "adamw_bnb_8bit",
              "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "lion_32bit", "paged_lion_8bit",
              "paged_lion_32bit", "adamw_torch_8bit", "adamw_torch_4bit", "schedule_free_adamw", "schedule_free_sgd",
              "schedule_free_radam", "lomo", "adalomo")
NONFINITE_POLICIES = ("raise", "skip")
#: torch.compile's modes (None is "default")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
RESUME_DATA_CHANGED = ("error", "restart_epoch")
SAVE_STRATEGIES = ("steps", "epoch", "best", "no")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: The seeds taken: those whose random streams differ from every other's. torch's CPU generator
#: (Mersenne Twister) and numpy's keep the low 32 bits of a seed, so torch.manual_seed(2**32) and
#: manual_seed(-(2**63)) give manual_seed(0)'s stream, and Python's random.seed(-n) is
#: random.seed(n): distinct seeds give distinct streams in [0, 2**32 - 1] only (Lightning's range).
SEED_MIN, SEED_MAX = 0, 2**32 - 1


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class FitConfig:
    """Every setting of a fit. Field names are the ``Fitter`` keyword arguments."""

    # -- where things go -------------------------------------------------------------------
    output_dir: str = _f("runs/lightlike", "Directory for checkpoints, logs and metrics files.")
    overwrite_output_dir: bool = _f(
        False, "Allow writing into an output_dir that already holds checkpoints or logs: lightlike's own "
        "checkpoints and log files there are removed, nothing else."
    )
    # -- hardware ----------------------------------------------------------------------------
    strategy: Any = _f("auto", "Strategy name ('auto', 'single', 'ddp', 'fsdp', ...), a preset file "
                               "(.toml: FSDP, .json: DeepSpeed) or a Strategy instance.")
    precision: Any = _f("auto", "Precision name ('32-true', 'bf16-mixed', ...) or an instance.")
    accelerator: str = _f("auto", "'auto', 'cpu' or 'cuda' (each process its local GPU); 'cuda:N' on one process.")
    # -- length of training --------------------------------------------------------------------
    max_epochs: int | float | None = _f(
        None, "Stop after this many epochs over the training data; a fraction (2.5, HF's num_train_epochs) stops "
        "after ceil(2.5 * optimizer steps per epoch) steps (the HF Trainer's count), the schedule's total too.")
    max_steps: int | None = _f(None, "Stop after this many optimizer steps (wins over max_epochs).")
    min_epochs: int | None = _f(None, "A stop asked for earlier (EarlyStopping, control.should_training_stop) waits "
                                      "until this many epochs are done (Lightning's min_epochs).")
    min_steps: int | None = _f(None, "A stop asked for earlier waits until this many optimizer steps are done "
                                     "(Lightning's min_steps).")
    limit_train_batches: int | float | None = _f(
        None, "Train on only the first N batches of each epoch (an int; per process), or that fraction of them (a "
        "float in (0, 1]), as Lightning's; the epoch, and max_epochs' steps, end there.")
    limit_val_batches: int | float | None = _f(
        None, "Evaluate on only the first N batches of each evaluation set (an int; per process), or that "
        "fraction of them (a float in [0, 1]); 0 evaluates nothing. During fit and validate(), as Lightning's.")
    # -- data ----------------------------------------------------------------------------------
    batch_size: int = _f(8, "Items per micro-batch on each process.")
    eval_batch_size: int | None = _f(None, "Items per evaluation batch (default: batch_size).")
    grad_accum_steps: int = _f(1, "Micro-batches per optimizer step.")
    num_workers: int = _f(0, "DataLoader worker processes.")
    drop_last: bool = _f(False, "Drop the last incomplete training batch of each epoch.")
    shuffle: bool = _f(True, "Shuffle the training data every epoch (permutation of seed, epoch).")
    pin_memory: bool = _f(False, "Pin host memory in DataLoaders (useful with CUDA).")
    remove_unused_columns: bool = _f(
        True, "A Hugging Face datasets.Dataset: drop the columns the module's model does not take (logged once, "
        "as the HF Trainer's remove_unused_columns); False passes every column to the collator.")
    seed: int = _f(0, "Seed for python, numpy, torch and DataLoader workers: 0 to 2**32 - 1 (the seeds whose "
                      "random streams all differ).")
    deterministic: bool = _f(False, "Use torch's deterministic algorithms during fit/validate/test/predict (as before them after).")
    # -- optimisation --------------------------------------------------------------------------
    optimizer: str = _f("adamw", "Optimizer by name, torch.optim's and the HF Trainer's (docs/optimizers.md: "
                        "GaLore, 8-bit, schedule-free, LOMO, ...): " + ", ".join(OPTIMIZERS)
                        + " (configure_optimizers wins).")
    optimizer_kwargs: dict | str = _f({}, "More arguments of the optimizer's class, e.g. {'nesterov': True, "
                                          "'momentum': 0.9} for 'sgd', or the HF Trainer's optim_args string "
                                          "'rank=64,update_proj_gap=200' (names as the class's; checked at once).")
    optimizer_target_modules: Any = _f(
        None, "GaLore optimizers: the modules whose weights get the low-rank projection: names, regexes, or "
        "'all-linear' (the HF Trainer's optim_target_modules).")
    learning_rate: float = _f(1e-3, "Peak learning rate.")
    weight_decay: float = _f(0.0, "Weight decay (decoupled in AdamW, the L2 term in SGD); never on norm weights, 1-D parameters or names containing 'bias' (as the HF Trainer).")
    adam_beta1: float = _f(0.9, "Adam-family (adamw, adam, nadam, radam) beta1.")
    adam_beta2: float = _f(0.999, "Adam-family beta2.")
    adam_epsilon: float = _f(1e-8, "Adam-family epsilon.")
    momentum: float = _f(0.0, "SGD and RMSprop momentum.")
    fused: bool | None = _f(None, "Use torch's fused kernel (None: for adamw and adam where torch has one, CUDA "
                                  "and CPU).")
    lr_scheduler: str = _f("linear", "One of: " + ", ".join(SCHEDULERS) + ".")
    lr_scheduler_kwargs: dict = _f({}, "The schedule's own arguments (HF's names): min_lr or min_lr_rate "
                                       "(cosine_with_min_lr); num_decay_steps or decay_ratio, decay_type, ... "
                                       "(wsd); timescale (inverse_sqrt); factor, patience, ... "
                                       "(reduce_lr_on_plateau).")
    warmup_steps: int = _f(0, "Linear warmup steps (wins over warmup_ratio).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total optimizer steps.")
    num_cycles: float = _f(
        0.5, "Cosine: number of waves (0.5 = half cosine); restarts: number of hard restarts."
    )
    lr_end: float = _f(1e-7, "Polynomial schedule: final learning rate.")
    power: float = _f(1.0, "Polynomial schedule: power.")
    max_grad_norm: float | None = _f(None, "Clip gradients to this global norm (unscaled).")
    max_grad_value: float | None = _f(None, "Clip each gradient element to [-v, v] (unscaled).")
    nonfinite_loss: str = _f(
        "raise",
        "'raise': a NaN/inf loss or gradient norm raises an error naming the step (read at log steps, "
        "saves and the end: no checkpoint after it); 'skip': the step is skipped, counted and warned "
        "about. A fit whose every step was skipped raises.",
    )
    # -- evaluation ----------------------------------------------------------------------------
    eval_every: int | None = _f(None, "Evaluate every this many optimizer steps.")
    eval_on_epoch_end: bool = _f(False, "Evaluate at the end of every epoch.")
    include_for_metrics: list = _f(
        [], "What compute_metrics(eval_pred) gets besides predictions and labels: 'inputs' (eval_pred.inputs, "
        "the batches' input_ids) and/or 'loss' (eval_pred.losses), as the HF Trainer's include_for_metrics.")
    eval_streaming: bool = _f(
        False, "Feed eval outputs to the module's streaming metrics instead of holding them all."
    )
    # -- logging -------------------------------------------------------------------------------
    log_every: int = _f(100, "Read the (device-side) training loss and log every this many steps.")
    loggers: Any = _f("auto", "'auto' (csv + tensorboard if installed), a list of names (csv, jsonl, tensorboard, "
                              "wandb, mlflow, comet, neptune) and/or Logger instances, or []")
    progress_bar: bool | None = _f(None, "Show a progress bar (None: only when stderr is a TTY).")
    model_summary: bool = _f(True, "Log a table of the module's parameters at fit start.")
    log_level: str = _f("info", "Python logging level of lightlike on the main process: "
                        + ", ".join(LOG_LEVELS) + ".")
    log_level_other_ranks: str = _f(
        "warning", "Python logging level of lightlike on the other processes (ranks 1, 2, ...)."
    )
    # -- checkpoints ---------------------------------------------------------------------------
    save_strategy: str = _f("steps", "When to save: 'steps' (every save_every steps), 'epoch' (at epoch ends), "
                                     "'best' (when metric_for_best improves), each also at the end of the fit "
                                     "(the trained model is kept); 'no': no checkpoint at all (a preemption signal "
                                     "still saves one).")
    save_every: int | None = _f(None, "With save_strategy='steps': save every this many steps. None: no periodic "
                                      "checkpoint, only the one at the end of the fit.")
    save_total_limit: int | None = _f(None, "Keep at most this many checkpoints (best is kept).")
    save_only_model: bool = _f(False, "Save weights only (no optimizer/scheduler/RNG: no resume).")
    verify_hashes: bool = _f(True, "Verify file hashes when loading a checkpoint (sizes always).")
    resume_data_changed: str = _f(
        "error", "A mid-epoch resume whose training data has another length than the checkpoint's: 'error' "
        "refuses it (the rest of the epoch would repeat and skip samples); 'restart_epoch' starts that epoch "
        "again from its start over the new data (its order: a function of seed and epoch), with a warning.")
    async_save: bool = _f(False, "Let training go on while a periodic checkpoint is made durable: "
                          "shards written in the background (FSDP), or fsync/hash/manifest in a thread; "
                          "committed at the next save or the end of the fit, invisible until then "
                          "(a fit that fails commits one whose files were all written, except FSDP's).")
    metric_for_best: str | None = _f(None, "Metric key that decides the best checkpoint: '<set>/<name>', e.g. "
                                           "'val/loss' or 'val/accuracy', or a name alone ('accuracy', HF's "
                                           "'eval_accuracy') for the one evaluation metric of that name (checked "
                                           "against the sets at set-up and the metrics at the first evaluation, "
                                           "after that step's checkpoint).")
    greater_is_better: bool | None = _f(None, "Whether larger metric_for_best is better. None: from the name: lower "
                                              "for a name ending in 'loss' or with the word error, err, perplexity, "
                                              "ppl, wer, cer, mse, rmse, mae, nll (or errors); higher otherwise.")
    load_best_at_end: bool = _f(
        False, "Load the best checkpoint's weights when fit ends. Every evaluation that improves metric_for_best "
        "is saved too, whatever save_every says, so the best is always on disk (and never rotated away)."
    )
    # -- preemption -------------------------------------------------------------------------------
    preemption_signals: list = _f(
        ["SIGTERM", "SIGUSR1"],
        "Signals that ask for a checkpoint and exit (code 75) at the next step boundary; [] disables.",
    )
    requeue_on_preemption: bool = _f(True, "Under SLURM, 'scontrol requeue' the job after a preemption save.")
    preemption_grace: float | None = _f(
        30.0, "Seconds a fit that got a preemption signal may wait for a DataLoader's next batch (a worker hung "
        "in __getitem__ never delivers it): past them it exits with code 75 without a new checkpoint (the last "
        "one stays valid). None: wait for ever.")
    # -- performance switches ------------------------------------------------------------------
    gradient_checkpointing: bool = _f(False, "Ask the module to checkpoint activations.")
    neftune_noise_alpha: float | None = _f(
        None, "NEFTune: add uniform noise of scale alpha / sqrt(length * dim) to the input embeddings while "
        "training (never in evaluation or prediction); the HF Trainer's neftune_noise_alpha.")
    use_liger_kernel: bool = _f(False, "Patch a supported transformers model with liger-kernel's Triton kernels "
                                       "before the strategy wraps it (CUDA only).")
    liger_kernel_config: dict = _f({}, "Arguments of liger-kernel's apply function for the model, e.g. "
                                       "{'rope': True, 'cross_entropy': False, 'fused_linear_cross_entropy': True}.")
    compile: bool = _f(False, "torch.compile each micro-batch's forward and loss as one function (evaluation: "
                              "forward, loss and metrics); the module's weights and names stay its own.")
    compile_mode: str | None = _f(None, "With compile=True: torch.compile's mode, one of "
                                        + ", ".join(COMPILE_MODES) + " (None: 'default').")
    compile_fullgraph: bool = _f(False, "With compile=True: torch.compile(fullgraph=True): a graph break in the "
                                        "module's forward, loss or metrics is an error instead of a split graph.")
    compile_dynamic: bool | None = _f(None, "With compile=True: torch.compile(dynamic=...): True compiles for "
                                            "dynamic shapes at once, False never, None after a shape changes.")
    compile_regions: bool = _f(False, "With compile=True: compile each repeated block (the module's "
                                      "compile_regions(), or the children of its largest nn.ModuleList of one "
                                      "class) and the loss, instead of the whole step: a deep model compiles "
                                      "once per block class, in far less time.")
    auto_find_batch_size: bool = _f(
        False, "On out-of-memory, about halve batch_size keeping the items per step (16x1 -> 8x2, 12x1 -> 6x2 -> "
        "3x4 -> 1x12) and retry from the module's initial weights and where the first try started (fresh, or "
        "the checkpoint it resumed), with a fresh loss scale. One process only: "
        "on several, an out-of-memory error fails fast like any other (the ranks that did not run out "
        "cannot retry with it)."
    )

    # ------------------------------------------------------------------------------------------
    def __new__(cls, *args: Any, **kwargs: Any) -> FitConfig:
        # the dataclass __init__ would raise a bare TypeError for an unknown keyword
        check_keys(kwargs, cls)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if isinstance(self.output_dir, os.PathLike):
            self.output_dir = os.fspath(self.output_dir)  # a pathlib.Path is a path too
        for f in dataclasses.fields(self):  # numpy scalars (a sweep over np.arange, say) as Python numbers
            v = getattr(self, f.name)
            if type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "ndim", None) == 0:
                setattr(self, f.name, v.item())
        if isinstance(self.optimizer_kwargs, str):  # the HF Trainer's optim_args, "k=v,k2=v2"
            from lightlike.optimizers.libraries import parse_optim_args

            self.optimizer_kwargs = parse_optim_args(self.optimizer_kwargs)
        self.validate()

    def need_stopping_criterion(self) -> None:
        """``fit`` needs one; evaluating or predicting alone does not."""
        if self.max_epochs is None and self.max_steps is None:
            raise ConfigError("no stopping criterion: set max_steps=N or max_epochs=N",
                              settings=("max_epochs", "max_steps"))

    def validate(self) -> None:
        def need(cond: bool, msg: str, *settings: str) -> None:
            if not cond:
                raise ConfigError(msg, settings=settings)

        for f in fields(self):  # types first: the checks below compare numbers
            value, default = getattr(self, f.name), f.default
            if value is None and f.default_factory is not dataclasses.MISSING:  # for the None hint only
                default = f.default_factory()
            _check_type(f.name, value, str(f.type), default)
        need(str(self.output_dir).strip() != "", "output_dir is empty: name the directory for checkpoints and logs "
             "(e.g. 'runs/my_run')", "output_dir")
        need(self.max_steps is None or self.max_steps > 0, f"max_steps must be a positive int, got {self.max_steps!r}",
             "max_steps")
        v = self.max_epochs
        need(v is None or math.isnan(v) or v != math.inf, "max_epochs=inf never ends: set max_steps (a learning-rate "
             "schedule spans it), or a number of epochs", "max_epochs")
        need(v is None or (math.isfinite(v) and v > 0),
             f"max_epochs must be a number of epochs > 0 (2 or 2.5), got {v!r}", "max_epochs")
        self._check_length_options(need)
        for name in ("batch_size", "grad_accum_steps", "log_every"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive int, got {v!r}", name)
        for name in ("eval_batch_size", "eval_every", "save_every", "save_total_limit"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and v > 0), f"{name} must be a positive int or None, got {v!r}", name)
        need(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers}", "num_workers")
        for name in ("learning_rate", "weight_decay", "adam_epsilon", "momentum", "lr_end"):
            v = getattr(self, name)
            need(math.isfinite(v), f"{name} must be finite, got {v!r}", name)
            need(v >= 0, f"{name} must be >= 0, got {v!r}", name)
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            need(0.0 <= v < 1.0, f"{name} must be in [0, 1), got {v!r}", name)
        for name in ("num_cycles", "power"):
            v = getattr(self, name)
            need(math.isfinite(v), f"{name} must be finite, got {v!r}", name)
        need(SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be in [0, 2**32 - 1]: torch's and numpy's generators keep only the low 32 bits of a seed "
             f"and Python's ignores its sign, so a seed outside that range gives the random streams of one inside "
             f"it (seed={self.seed!r} draws torch's and numpy's streams of seed={self.seed % 2**32}); got {self.seed!r}",
             "seed")
        need(0.0 <= self.warmup_ratio < 1.0, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}", "warmup_ratio")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps!r}", "warmup_steps")
        _choice("lr_scheduler", self.lr_scheduler, SCHEDULERS)
        from lightlike.optimizers import check_optimizer_kwargs  # (torch, and the library a name needs)
        from lightlike.schedules import check_schedule_kwargs

        check_optimizer_kwargs(self.optimizer, self.optimizer_kwargs)  # a name refused, a library missing: why
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        check_schedule_kwargs(self.lr_scheduler, self.lr_scheduler_kwargs)
        _choice("nonfinite_loss", self.nonfinite_loss, NONFINITE_POLICIES)
        _choice("resume_data_changed", self.resume_data_changed, RESUME_DATA_CHANGED)
        _choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        if self.compile_mode is not None:
            _choice("compile_mode", self.compile_mode, COMPILE_MODES)
        self._check_compile_options()
        self._check_fine_tuning_options(need)
        for name in ("log_level", "log_level_other_ranks"):
            _choice(name, getattr(self, name).strip().lower(), LOG_LEVELS, shown=getattr(self, name))
        for name in ("max_grad_norm", "max_grad_value"):
            v = getattr(self, name)
            need(v is None or (math.isfinite(v) and v > 0), f"{name} must be a finite number > 0 or None, got {v!r}", name)
        self._check_saving_and_preemption(need)

    def _check_saving_and_preemption(self, need: Any) -> None:
        """The preemption grace and signals (named and catchable, before any fit); what the best
        checkpoint needs."""
        grace = self.preemption_grace
        need(grace is None or (math.isfinite(grace) and grace > 0),
             f"preemption_grace must be a number of seconds > 0 or None, got {grace!r}", "preemption_grace")
        from lightlike.preemption import signal_number  # light: signal, os, subprocess

        for name in self.preemption_signals:  # named and catchable, checked before any fit
            try:
                signal_number(name)
            except ConfigError as e:
                raise ConfigError(str(e), settings=("preemption_signals",)) from None
        if self.save_strategy == "best" or self.load_best_at_end:
            need(
                self.metric_for_best is not None,
                "save_strategy='best' and load_best_at_end need metric_for_best (e.g. 'val/loss')",
                "save_strategy", "load_best_at_end", "metric_for_best",
            )
        need(not (self.load_best_at_end and self.save_strategy == "no"),
             "load_best_at_end=True but save_strategy='no' saves no checkpoint to load: use save_strategy='steps' "
             "(the default), 'epoch' or 'best', or drop load_best_at_end", "load_best_at_end", "save_strategy")

    def _check_length_options(self, need: Any) -> None:
        """min_epochs / min_steps within max_epochs / max_steps; the batch limits' ranges."""
        for name, most in (("min_epochs", self.max_epochs), ("min_steps", self.max_steps)):
            v = getattr(self, name)
            need(v is None or v >= 0, f"{name} must be an int >= 0 or None, got {v!r}", name)
            need(v is None or most is None or v <= most, f"{name}={v!r} is more than max_{name[4:]}={most!r}: the "
                 f"run ends at max_{name[4:]}; lower {name} or raise max_{name[4:]}", name, f"max_{name[4:]}")
        for name in ("limit_train_batches", "limit_val_batches"):
            v = getattr(self, name)
            need(v is None or (v >= 0 if isinstance(v, int) else 0.0 <= v <= 1.0), f"{name} must be a number of "
                 f"batches (an int >= 0) or a fraction of them (a float in [0, 1]), got {v!r}", name)
        need(not (self.limit_val_batches == 0 and self.metric_for_best), f"limit_val_batches=0 evaluates nothing, so "
             f"metric_for_best={self.metric_for_best!r} never has a value: drop one of them", "limit_val_batches",
             "metric_for_best")
        need(self.limit_train_batches != 0, "limit_train_batches=0 trains on nothing: to only evaluate, call "
             "Fitter.validate(module, data); to train on every batch, leave limit_train_batches out",
             "limit_train_batches")

    def _check_fine_tuning_options(self, need: Any) -> None:
        """The HF fine-tuning fields: include_for_metrics, NEFTune and Liger."""
        need(not isinstance(self.include_for_metrics, str) and set(self.include_for_metrics) <= {"inputs", "loss"},
             f"include_for_metrics takes a list of 'inputs' and/or 'loss', got {self.include_for_metrics!r}",
             "include_for_metrics")
        alpha = self.neftune_noise_alpha  # NEFTune and Liger (lightlike/interop/neftune.py, liger.py)
        need(alpha is None or (math.isfinite(alpha) and alpha > 0), "neftune_noise_alpha must be a finite number > 0 "
             f"(the NEFTune paper uses 5, 10, 15) or None, got {alpha!r}", "neftune_noise_alpha")
        need(self.use_liger_kernel or not self.liger_kernel_config, "liger_kernel_config is set but use_liger_kernel "
             "is False: set use_liger_kernel=True, or drop liger_kernel_config", "use_liger_kernel", "liger_kernel_config")

    def _check_compile_options(self) -> None:
        """The compile_* options act with ``compile=True`` only: one set without it is an error
        rather than a setting that silently does nothing."""
        if self.compile:
            return
        given = [f"{name}={getattr(self, name)!r}" for name, unset in
                 (("compile_mode", None), ("compile_fullgraph", False), ("compile_dynamic", None),
                  ("compile_regions", False)) if getattr(self, name) != unset]
        if given:
            raise ConfigError(f"{', '.join(given)} set but compile=False: these options act on torch.compile only; "
                              "set compile=True, or drop them", settings=("compile", *(g.split("=")[0] for g in given)))

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("strategy", "precision") and not isinstance(v, str):
                v = getattr(v, "name", type(v).__name__)
            if f.name == "loggers" and v is not None and not isinstance(v, str):  # Logger instances by class
                items = list(v) if isinstance(v, (list, tuple)) else [v]
                v = [x if isinstance(x, str) else type(x).__name__ for x in items]
            if isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitConfig:
        check_keys(data, cls)
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> FitConfig:
        text = read_if_path(path_or_text)
        return cls.from_dict(json.loads(text))

    def to_toml(self, path: str | Path | None = None) -> str:
        lines = []
        defaults = {f.name: f.default for f in fields(self)}
        for k, v in self.to_dict().items():
            if v is None:  # TOML has no null: an absent key means the default, right only if that is None
                if defaults.get(k) is not None:
                    raise ConfigError(f"{k}=None cannot be written as TOML (it has no null; reading it back would "
                                      f"give the default {defaults[k]!r}): write JSON or YAML instead")
                continue
            lines.append(f"{k} = {toml_value(v)}")
        text = "\n".join(lines) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_toml(cls, path_or_text: str | Path) -> FitConfig:
        from lightlike.utils import toml

        text = read_if_path(path_or_text)
        return cls.from_dict(toml.loads(text))

    def replace(self, **changes: Any) -> FitConfig:
        check_keys(changes, type(self))
        return dataclasses.replace(self, **changes)

    @classmethod
    def help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def field_defaults(cls: type = FitConfig) -> dict[str, Any]:
    """Every field's default (a fresh one where a factory makes it: ``optimizer_kwargs``'s ``{}``)."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in fields(cls)}


def check_keys(data: dict[str, Any], cls: type = FitConfig) -> None:
    """Reject unknown keys, naming the closest valid ones."""
    valid = [f.name for f in fields(cls)]
    bad = [k for k in data if k not in valid]
    if bad:
        parts = []
        for k in bad:
            other = other_name_hint(k) if cls is FitConfig else None
            close = [repr(c) for c in difflib.get_close_matches(k, valid, n=3, cutoff=0.5)]
            hint = f" ({other})" if other else f" (did you mean {', '.join(close)}?)" if close else ""
            parts.append(f"{k!r}{hint}")
        raise ConfigError(f"unknown config key(s): {'; '.join(parts)}")


def _choice(name: str, value: Any, valid: tuple[str, ...], shown: Any = None) -> None:
    if value not in valid:
        lower = str(value).lower()  # the names are lower-case: 'AdamW' is 'adamw', not the closest spelling 'adam'
        close = [lower] if lower in valid else difflib.get_close_matches(lower, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        shown = value if shown is None else shown
        raise ConfigError(f"{name}={shown!r} is not valid{hint}; choose one of: {', '.join(valid)}", settings=(name,))


_TAKES = {"int": "an int", "float": "a number (int or float)", "bool": "True or False", "str": "a string",
          "list": "a list", "dict": "a dict", "None": "None"}


def _accepts(value: Any, kind: str) -> bool:
    if kind == "Any":
        return True
    if kind == "None":
        return value is None
    if isinstance(value, bool):  # bool is an int subclass, but not a count or a rate here
        return kind == "bool"
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    types: dict[str, type | tuple[type, ...]] = {"bool": bool, "str": str, "list": (list, tuple), "dict": dict}
    return isinstance(value, types.get(kind, object))


def _check_type(name: str, value: Any, annotation: str, default: Any) -> None:
    """One ``ConfigError`` naming the field, the value and what it takes. Strings are not
    converted: the command line and config-file readers (``cli_args``) do that before here."""
    kinds = [k.strip() for k in annotation.split("|")]
    if any(_accepts(value, k) for k in kinds):
        return
    takes = " or ".join(_TAKES.get(k, k) for k in kinds if k != "int" or "float" not in kinds)  # a number: both
    hint = ""
    if value is None:
        shown = default if default is not dataclasses.MISSING else "its default"
        hint = f"; None is not accepted here: leave {name} out for its default ({shown!r})"
    elif isinstance(value, str):
        for kind, parse in (("bool", _parse_bool), ("int", int), ("float", float)):
            if kind in kinds:
                try:
                    hint = f"; write {name}={parse(value)!r}, not the string {value!r}"
                    break
                except ValueError:
                    pass
    elif isinstance(value, bool):
        hint = f"; {value!r} is a bool, not a number"
    elif isinstance(value, float) and "int" in kinds and value.is_integer():
        hint = f"; write {name}={int(value)}"
    raise ConfigError(f"{name}={value!r} ({type(value).__name__}) is not valid: {name} takes {takes}{hint}",
                      settings=(name,))


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low not in ("true", "false"):
        raise ValueError(text)
    return low == "true"

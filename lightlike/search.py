"""Hyperparameter search over optuna: ``Fitter.search(module_factory, space, n_trials)``.

Each trial is a fresh fit: a new ``Fitter`` with the searching Fitter's config, the trial's
overrides and ``output_dir=<output_dir>/trial-<n>``, and a new module from ``module_factory``
built after the Fitter has seeded the random generators (so refitting a trial's parameters
reproduces it). The trial's value is ``metric`` from the fit's last evaluation.

``space`` is either a dict ``name -> optuna distribution`` (a list is shorthand for a
categorical one) or a callable ``space(trial) -> dict`` that calls ``trial.suggest_*`` itself.
Each sampled name that is a ``FitConfig`` field overrides the config; the others are passed to
``module_factory`` as keyword arguments.

Pruning: at every evaluation the metric is reported to the trial (``trial.report(value,
step=global_step)``); when the study's pruner says so the fit stops at that step boundary and
the trial ends as pruned. On several processes rank 0 runs the study; the other ranks receive
each trial's parameters and pruning decisions, and every rank returns an equal study.

optuna is imported when a search starts, not before.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightlike.best import greater_is_better, key_candidates
from lightlike.callbacks.base import Callback
from lightlike.config import FitConfig
from lightlike.errors import ConfigError, OutputDirError
from lightlike.preemption import EXIT_PREEMPTED, PreemptionHandler

if TYPE_CHECKING:
    from lightlike.fitter import Fitter

log = logging.getLogger("lightlike")


class PruningCallback(Callback):
    """Reports ``metric`` to the optuna trial at every evaluation and stops the fit when the
    pruner says so (decided on rank 0, agreed by every rank)."""

    def __init__(self, trial: Any, metric: str):
        self.trial, self.metric = trial, metric
        self.pruned_at: int | None = None

    def on_evaluate(self, fitter: Fitter, state: Any, control: Any, metrics: dict[str, float]) -> None:
        key = searched_key(self.metric, metrics, "the evaluation metrics")
        strategy = fitter.strategy
        assert strategy is not None
        prune = False
        if self.trial is not None:  # rank 0
            self.trial.report(metrics[key], step=state.global_step)
            prune = self.trial.should_prune()
        if strategy.world_size > 1:
            prune = strategy.collectives.broadcast_object(prune)
        if prune:
            self.pruned_at = state.global_step
            control.should_training_stop = True


def search(fitter: Fitter, module_factory: Callable[..., Any], space: Any, n_trials: int, *,
           train: Any = None, val: Any = None, direction: str | None = None, metric: str | None = None,
           sampler_seed: int | None = 0, sampler: Any = None, pruner: Any = None, study: Any = None,
           timeout: float | None = None) -> Any:
    """Run ``n_trials`` fits and return the optuna ``Study`` (``study.best_params``,
    ``study.best_value``, ``study.best_trial.user_attrs["output_dir"]``).

    ``train``/``val``: the data of every trial (default: the module's ``train_data()`` /
    ``val_data()``). ``metric`` (default: ``metric_for_best`` or ``"val/loss"``) is the trial's
    value; ``direction`` (default: from ``greater_is_better``, else from the metric's name as for
    ``metric_for_best``: ``lightlike.best.greater_is_better``). ``sampler`` (default:
    ``TPESampler(seed=sampler_seed)``) and ``pruner`` (default: optuna's ``MedianPruner``) go
    to ``optuna.create_study``; an existing ``study`` (e.g. with storage, to continue it) is used
    as it is, with its own direction, sampler and pruner. ``timeout`` (seconds) as in
    ``study.optimize``."""
    import optuna

    base = fitter.config
    metric = metric or base.metric_for_best or "val/loss"
    if direction is None:
        greater = greater_is_better(metric, base.greater_is_better if metric == base.metric_for_best else None)
        direction = "maximize" if greater else "minimize"
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"direction must be 'minimize' or 'maximize', got {direction!r}")
    if not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials must be a positive int, got {n_trials!r}")
    if not (callable(space) or isinstance(space, Mapping)):
        raise ConfigError(f"space must be a dict of optuna distributions or a callable(trial) -> dict, "
                          f"got {type(space).__name__}")
    trials = _Trials(fitter, module_factory, metric, train, val)
    _check_space_names(space, module_factory, trials.config_keys)
    trials.between.install()
    try:
        if trials.strategy.is_global_zero:
            if study is None:
                sampler = sampler if sampler is not None else optuna.samplers.TPESampler(seed=sampler_seed)
                study = optuna.create_study(direction=direction, sampler=sampler, pruner=pruner)  # type: ignore[arg-type]
            return _lead(trials, study, space, n_trials, timeout)
        return _follow(trials)
    finally:
        trials.between.uninstall()


def searched_key(metric: str, metrics: dict[str, float], where: str) -> str:
    """The evaluation metric that ``metric`` names: itself, or for a name alone (``accuracy``,
    ``eval_loss``, as ``metric_for_best`` takes it) the one metric of that name
    (``lightlike.best.key_candidates``). A ``ConfigError`` when there is none, or several."""
    found = key_candidates(metric, [k for k in metrics if not k.startswith("train/")])
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"search metric {metric!r} matches several evaluation metrics {found}: name its set")
    raise ConfigError(f"search metric {metric!r} is not among {where} {sorted(metrics)}")


class _Trials:
    """Runs one trial's fit on this rank: a fresh Fitter with the trial's overrides and its own
    ``output_dir``, a fresh module from the factory, and the pruning callback."""

    def __init__(self, fitter: Fitter, module_factory: Callable[..., Any], metric: str, train: Any, val: Any):
        self.fitter, self.factory, self.metric, self.train, self.val = fitter, module_factory, metric, train, val
        self.base = fitter.config
        self.strategy = fitter.setup_strategy()
        self.config_keys = {f.name for f in fields(FitConfig)}
        self.between = PreemptionHandler(self.base.preemption_signals)  # a signal between trials (each fit has its own)

    def output_dir(self, number: int) -> str:
        return str(Path(self.base.output_dir) / f"trial-{number}")

    def run(self, number: int, params: Mapping[str, Any], trial: Any) -> tuple[float | None, Any, PruningCallback]:
        """The trial's value (None when it was pruned), its FitResult and its pruning callback."""
        overrides = {k: v for k, v in params.items() if k in self.config_keys}
        module_kwargs = {k: v for k, v in params.items() if k not in self.config_keys}
        cfg = self.base.replace(**{**overrides, "output_dir": self.output_dir(number)})
        pruning = PruningCallback(trial, self.metric)
        callbacks = [_fresh(cb) for cb in self.fitter.user_callbacks] + [pruning]
        trial_fitter = type(self.fitter)(cfg, callbacks=callbacks)  # seeds: the module below starts the same
        module = self.factory(**module_kwargs)
        tr, va = _data(module, self.train, self.val)
        if va is None:
            raise ConfigError("search needs evaluation data for its metric: pass val=... (or define val_data())")
        _stop_if_preempted(self.strategy, [self.between], f"before trial {number}")
        try:
            result = trial_fitter.fit(module, tr, va)
        except OutputDirError:  # its resume hint does not apply: a trial is not resumed
            raise OutputDirError(
                f"search: {cfg.output_dir!r} already holds a run (an earlier search's trial?); choose another "
                "output_dir, pass overwrite_output_dir=True to replace the trials, or, to continue an earlier "
                "search, pass study= its optuna study (with its storage): new trials get new numbers",
                offers=("overwrite_output_dir=True",)) from None
        _stop_if_preempted(self.strategy, [self.between, trial_fitter.preemption], f"during trial {number}")
        try:
            key = searched_key(self.metric, result.metrics, "the fit's metrics")
        except ConfigError as error:
            raise ConfigError(f"{error}; pass val=... (and eval_every for pruning)") from None
        return (None if pruning.pruned_at is not None else result.metrics[key]), result, pruning


def _lead(trials: _Trials, study: Any, space: Any, n_trials: int, timeout: float | None) -> Any:
    """Rank 0 runs the study; on several processes it announces each trial's number and
    parameters, then the end and the finished trials."""
    import optuna

    strategy = trials.strategy

    def objective(trial: Any) -> float:
        params = space(trial) if callable(space) else _suggest(trial, space)
        if not isinstance(params, Mapping):
            raise ConfigError(f"space(trial) must return a dict of overrides, got {type(params).__name__}")
        params = dict(params)
        _check_names(params, trials.factory, trials.config_keys)
        if strategy.world_size > 1:
            strategy.collectives.broadcast_object((trial.number, params))
        # set first: a trial that fails (or is killed) still names its folder and settings
        trial.set_user_attr("output_dir", trials.output_dir(trial.number))
        trial.set_user_attr("overrides", _jsonable(params))
        value, result, pruning = trials.run(trial.number, params, trial)
        trial.set_user_attr("global_step", result.global_step)
        if value is None:
            raise optuna.TrialPruned(f"pruned at step {pruning.pruned_at} ({trials.metric})")
        return value

    study.optimize(objective, n_trials=n_trials, timeout=timeout)
    if strategy.world_size > 1:
        strategy.collectives.broadcast_object(None)  # no more trials
        strategy.collectives.broadcast_object((study.direction.name.lower(), study.trials))
    return study


def _follow(trials: _Trials) -> Any:
    """Ranks other than 0: run the trials rank 0 announces, with its pruning decisions, and
    return a study equal to rank 0's."""
    import optuna

    collectives = trials.strategy.collectives
    while (announced := collectives.broadcast_object(None)) is not None:
        number, params = announced
        trials.run(number, params, None)
    direction, finished = collectives.broadcast_object(None)
    study = optuna.create_study(direction=direction)  # type: ignore[arg-type]
    study.add_trials(finished)
    return study


def _stop_if_preempted(strategy: Any, handlers: list[Any], after: str) -> None:
    """Every rank agrees whether a preemption signal came (one may end a trial before its fit
    acts on it): the search stops with exit 75. It is not requeued: a search does not resume
    (pass ``study=`` with a storage to continue one)."""
    names = [h.signal_name for h in handlers if h.received is not None]
    if strategy.collectives.reduce_flag(bool(names)) if strategy.world_size > 1 else names:
        log.warning("%s received %s: the search stops (exit %d; a search does not resume, pass study= with a "
                    "storage to continue it)", names[0] if names else "a signal on another rank", after, EXIT_PREEMPTED)
        raise handlers[0].preempted(names[0] if names else "a signal on another rank", None)


def _suggest(trial: Any, space: Mapping[str, Any]) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    params: dict[str, Any] = {}
    for name, dist in space.items():
        if isinstance(dist, (list, tuple)):
            dist = CategoricalDistribution(list(dist))
        if isinstance(dist, FloatDistribution):
            params[name] = trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, IntDistribution):
            params[name] = trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, CategoricalDistribution):
            params[name] = trial.suggest_categorical(name, dist.choices)
        else:
            raise ConfigError(f"space[{name!r}] is a {type(dist).__name__}; use an optuna FloatDistribution, "
                              "IntDistribution or CategoricalDistribution (or a list of choices)")
    return params


def _check_space_names(space: Any, factory: Callable[..., Any], config_keys: set[str]) -> None:
    if isinstance(space, Mapping):
        _check_names(space, factory, config_keys)


def _check_names(params: Mapping[str, Any], factory: Callable[..., Any], config_keys: set[str]) -> None:
    """Every name must be a FitConfig field or a keyword the module factory accepts."""
    if "output_dir" in params:
        raise ConfigError("the search space cannot set output_dir: every trial writes to <output_dir>/trial-<n>")
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = {n for n, p in sig.parameters.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    bad = [k for k in params if k not in config_keys and k not in accepted]
    if bad:
        import difflib

        from lightlike.config import other_name_hint

        hints = []
        for k in bad:  # an HF Trainer / Lightning name (lr, num_train_epochs) is answered with the field
            close = difflib.get_close_matches(k, [*config_keys, *accepted], n=1, cutoff=0.6)
            other = other_name_hint(k)
            hints.append(f"{k!r}" + (f" ({other})" if other else f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"search space name(s) {', '.join(hints)} are neither FitConfig fields nor keyword "
                          f"arguments of module_factory (it takes {sorted(accepted) or 'none'})")


def _data(module: Any, train: Any, val: Any) -> tuple[Any, Any]:
    if train is None:
        if not callable(getattr(module, "train_data", None)):
            raise ConfigError("search needs training data: pass train=... (and val=...), or define "
                              "train_data()/val_data() on the module")
        train = module.train_data()
        if val is None and callable(getattr(module, "val_data", None)):
            val = module.val_data()
    return train, val


def _fresh(cb: Callback) -> Callback:
    """A copy of a user callback for one trial (an EarlyStopping's best value must not leak
    from one trial into the next); the callback itself when it cannot be copied."""
    try:
        return copy.deepcopy(cb)
    except Exception:  # noqa: BLE001 - e.g. a callback holding a lock or an open file
        return cb


def _jsonable(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)) for k, v in params.items()}


__all__ = ["PruningCallback", "search"]

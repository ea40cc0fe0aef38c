"""``Fitter.search`` (optuna), single process, small and fast: the study's direction from the
config, the dict space's distributions kept as given, the names a space may set, and fresh
callbacks for every trial. (The end-to-end searches, pruning and 2 processes are in
test_interop.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import Classifier, DictDataset

import lightlike as ll

optuna = pytest.importorskip("optuna")
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402

QUIET = {"loggers": [], "log_level": "warning", "model_summary": False, "progress_bar": False}
MIN, MAX = optuna.study.StudyDirection.MINIMIZE, optuna.study.StudyDirection.MAXIMIZE


def tiny_fitter(out, **kw):
    return ll.Fitter(max_steps=2, eval_every=1, batch_size=8, output_dir=str(out), seed=0, **QUIET, **kw)


def tiny_search(fitter, space, n_trials=1, factory=Classifier, **kw):
    return fitter.search(factory, space, n_trials, train=DictDataset(16), val=DictDataset(8, seed=1),
                         pruner=optuna.pruners.NopPruner(), **kw)


LR = {"learning_rate": FloatDistribution(1e-3, 1e-1, log=True)}


# -- the direction: greater_is_better when the searched metric is metric_for_best -----------------
@pytest.mark.parametrize(("metric_for_best", "greater", "metric", "want"), [
    ("val/accuracy", True, None, MAX),
    ("val/accuracy", False, None, MIN),   # not the name-based guess ("maximize" for a non-loss)
    ("val/loss", True, None, MAX),        # not the name-based guess ("minimize" for a loss)
    ("val/loss", False, None, MIN),
    ("val/accuracy", True, "val/loss", MIN),       # another metric: greater_is_better is not its
    ("val/loss", False, "val/accuracy", MAX),
    (None, None, None, MIN),                       # val/loss by default
    (None, None, "val/accuracy", MAX),
])
def test_search_direction_follows_greater_is_better_of_its_metric(tmp_path, metric_for_best, greater, metric, want):
    fitter = tiny_fitter(tmp_path / "s", metric_for_best=metric_for_best, greater_is_better=greater)
    study = tiny_search(fitter, LR, metric=metric)
    assert study.direction == want
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    searched = metric or metric_for_best or "val/loss"
    assert study.trials[0].intermediate_values[2] == study.trials[0].value  # the value is that metric's
    refit = tiny_fitter(tmp_path / "refit", **study.best_params).fit(Classifier(), DictDataset(16),
                                                                   DictDataset(8, seed=1))
    assert refit.metrics[searched] == study.best_value


def test_a_metric_for_best_named_alone_is_the_searched_metric(tmp_path):
    """metric_for_best='eval_loss' (the HF Trainer's spelling of val/loss): the study minimises it
    and each evaluation reports it; the trial's value is the refit's val/loss."""
    study = tiny_search(tiny_fitter(tmp_path / "s", metric_for_best="eval_loss"), LR)
    assert study.direction == MIN and study.trials[0].state == optuna.trial.TrialState.COMPLETE
    refit = tiny_fitter(tmp_path / "refit", **study.best_params).fit(Classifier(), DictDataset(16),
                                                                   DictDataset(8, seed=1))
    assert study.trials[0].intermediate_values[2] == refit.metrics["val/loss"] == study.best_value


def test_an_explicit_direction_wins(tmp_path):
    fitter = tiny_fitter(tmp_path / "s", metric_for_best="val/accuracy", greater_is_better=True)
    assert tiny_search(fitter, LR, direction="minimize").direction == MIN


# -- the dict space: its distributions reach optuna as given ------------------------------------
def test_dict_space_distributions_are_kept(tmp_path):
    space = {"learning_rate": FloatDistribution(1e-3, 1e-1, log=True), "width": IntDistribution(4, 16, step=4),
             "weight_decay": FloatDistribution(0.0, 0.5, step=0.25), "features": [8]}
    study = tiny_search(tiny_fitter(tmp_path / "s"), space, n_trials=3)
    for t in study.trials:
        assert t.distributions == {
            "learning_rate": FloatDistribution(1e-3, 1e-1, log=True), "width": IntDistribution(4, 16, step=4),
            "weight_decay": FloatDistribution(0.0, 0.5, step=0.25), "features": CategoricalDistribution([8]),
        }
        assert t.params["width"] in (4, 8, 12, 16) and t.params["weight_decay"] in (0.0, 0.25, 0.5)
        assert t.user_attrs["overrides"] == t.params


# -- the names a space may set ---------------------------------------------------------------------
def test_space_cannot_set_output_dir(tmp_path):
    with pytest.raises(ll.ConfigError, match="cannot set output_dir"):
        tiny_search(tiny_fitter(tmp_path / "s"), {**LR, "output_dir": ["a", "b"]})
    assert not (tmp_path / "s").exists()

    def space(trial):
        return {"output_dir": trial.suggest_categorical("out", ["a"])}

    with pytest.raises(ll.ConfigError, match="cannot set output_dir"):
        tiny_search(tiny_fitter(tmp_path / "s"), space)
    assert not (tmp_path / "s" / "trial-0").exists()


def test_names_returned_by_a_callable_space_are_checked(tmp_path):
    def space(trial):
        return {"learning_rate": trial.suggest_float("lr", 1e-3, 1e-1), "widht": trial.suggest_int("w", 4, 8)}

    with pytest.raises(ll.ConfigError, match=r"'widht' \(did you mean 'width'\?\) are neither FitConfig fields"):
        tiny_search(tiny_fitter(tmp_path / "s"), space)
    assert not (tmp_path / "s" / "trial-0").exists()  # refused before the trial's fit


def test_hf_names_in_a_search_space_get_the_field(tmp_path):
    """``lr`` (HF/optuna habit) got no hint, though ``--lr`` and Fitter(lr=...) name learning_rate."""
    with pytest.raises(ll.ConfigError, match=r"'lr' \(did you mean 'learning_rate'\?\) are neither"):
        tiny_search(tiny_fitter(tmp_path / "s"), {"lr": FloatDistribution(1e-3, 1e-1)})


def test_a_failing_trial_stops_the_search_and_names_its_folder(tmp_path):
    """A trial that raises stops the search with its error (optuna's default, documented); its
    folder and settings were recorded only after a success, so a failed trial named neither."""

    class Broken(Classifier):
        def loss(self, outputs, batch):
            raise RuntimeError("broken loss")

    study = optuna.create_study()
    with pytest.raises(RuntimeError, match="broken loss"):
        tiny_search(tiny_fitter(tmp_path / "s"), LR, factory=Broken, study=study)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.FAIL
    assert trial.user_attrs["output_dir"] == str(tmp_path / "s" / "trial-0")
    assert set(trial.user_attrs["overrides"]) == {"learning_rate"}


# -- callbacks: every trial gets its own copy -------------------------------------------------------
class CountEvaluations(ll.Callback):
    finished: list[tuple[Any, int]] = []  # (the instance, kept so its id is not reused; evaluations it saw), per fit

    def __init__(self):
        self.evaluations = 0

    def on_evaluate(self, fitter, state, control, metrics):
        self.evaluations += 1

    def on_fit_end(self, fitter, state, control):
        CountEvaluations.finished.append((self, self.evaluations))


def test_every_trial_gets_fresh_copies_of_the_callbacks(tmp_path, monkeypatch):
    monkeypatch.setattr(CountEvaluations, "finished", [])
    counter = CountEvaluations()
    stopper = ll.EarlyStopping(monitor="val/loss", patience=5)
    fitter = ll.Fitter(max_steps=2, eval_every=1, batch_size=8, output_dir=str(tmp_path / "s"), seed=0,
                       callbacks=[counter, stopper], **QUIET)
    study = tiny_search(fitter, LR, n_trials=3)
    assert len(study.trials) == 3
    # each trial counted its own 2 evaluations (not 2, 4, 6), on an instance of its own
    assert [n for _, n in CountEvaluations.finished] == [2, 2, 2]
    assert len({id(c) for c, _ in CountEvaluations.finished} | {id(counter)}) == 4
    # the user's objects were not used
    assert counter.evaluations == 0
    assert (stopper.best, stopper.wait, stopper.stopped_step) == (None, 0, None)


def test_a_signal_that_a_trial_ends_before_acting_on_stops_the_search(tmp_path):
    """SIGTERM at a trial's last step: that fit ends normally (no preemption at a run's last
    step), and the search went on with every later trial until the scheduler killed the job.
    Now the search stops after that trial with exit 75 (Preempted), and the handler is restored."""
    import os
    import signal

    from lightlike.preemption import EXIT_PREEMPTED, Preempted

    class SignalAtTheEnd(ll.Callback):
        trials = 0  # on the class: each trial gets its own copy of the callback

        def on_fit_start(self, fitter, state, control):
            type(self).trials += 1

        def on_step_end(self, fitter, state, control):
            if state.global_step == state.max_steps:
                os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    fitter = tiny_fitter(tmp_path, callbacks=[SignalAtTheEnd()])
    with pytest.raises(Preempted) as stopped:
        tiny_search(fitter, LR, n_trials=3, study=optuna.create_study())
    assert stopped.value.code == EXIT_PREEMPTED
    assert SignalAtTheEnd.trials == 1
    assert signal.getsignal(signal.SIGTERM) == before

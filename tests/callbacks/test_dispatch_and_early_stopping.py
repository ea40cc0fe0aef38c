"""Callback dispatch and flag rules, EarlyStopping state (mutation round BD)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.callbacks.checks import GradientCheckpointingCheck, built_in_callbacks
from lightlike.state import Control


def _fit(tmp_path, callbacks, **kw):
    cfg = dict(batch_size=4, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False,
               shuffle=False, learning_rate=1e-2)
    cfg.update(kw)
    return ll.Fitter(callbacks=callbacks, **cfg)


class LogSteps(ll.Callback):
    def __init__(self):
        self.logged, self.evaluated, self.epoch_ends = [], [], []

    def on_log(self, fitter, state, control, metrics):
        if "train/loss" in metrics:
            self.logged.append(state.global_step)

    def on_evaluate(self, fitter, state, control, metrics):
        self.evaluated.append(state.global_step)

    def on_epoch_end(self, fitter, state, control):
        self.epoch_ends.append(state.global_step)


@pytest.mark.parametrize("flag", ["should_log", "should_evaluate"])
def test_log_or_evaluate_asked_for_in_on_save_is_dropped(tmp_path, flag):
    """should_log / should_evaluate set in on_save come after the step's checkpoint: dropped with a
    warning, not acted on at the next step (a killed and resumed run would not)."""

    class Late(ll.Callback):
        def on_save(self, fitter, state, control, path):
            setattr(control, flag, True)

    rec = LogSteps()
    with pytest.warns(UserWarning, match=f"control.{flag} set in Late.on_save is ignored"):
        _fit(tmp_path, [Late(), rec], max_steps=6, save_every=2, log_every=100, eval_every=100).fit(
            Classifier(), DictDataset(n=40), DictDataset(n=8, seed=1))
    assert rec.logged == [6]  # the final row only
    assert rec.evaluated == [6]  # the final evaluation only


def test_two_stateless_callbacks_of_one_class_save_fine(tmp_path):
    """Callbacks without state (state_dict() == {}) share their class name as state_key without
    harm: nothing of theirs goes into the checkpoint."""

    class Quiet(ll.Callback):
        def on_step_end(self, fitter, state, control):
            pass

    result = _fit(tmp_path, [Quiet(), Quiet()], max_steps=2, save_every=2).fit(Classifier(), DictDataset(n=16))
    assert result.global_step == 2 and (tmp_path / "run" / "checkpoint-2").is_dir()


def test_gradient_checkpointing_check_skipped_for_modules_that_handle_the_flag():
    """A module that overrides gradient_checkpointing_enable handles the switch itself (as the
    transformers adapter does): no check, hence no spurious warning."""

    class Handles(Classifier):
        def gradient_checkpointing_enable(self):
            pass

    cfg = SimpleNamespace(progress_bar=False, gradient_checkpointing=True)
    assert not any(isinstance(c, GradientCheckpointingCheck) for c in built_in_callbacks(cfg, Handles(), True))
    assert any(isinstance(c, GradientCheckpointingCheck) for c in built_in_callbacks(cfg, Classifier(), True))


# -- EarlyStopping -----------------------------------------------------------------------------
def _es_event(es, value, step, fitter):
    control = Control()
    es.on_evaluate(fitter, SimpleNamespace(global_step=step), control, {"val/loss": value})
    return control.should_training_stop


def test_early_stopping_refuses_patience_zero_and_takes_min_delta_by_size():
    with pytest.raises(ll.ConfigError, match="patience"):
        ll.EarlyStopping(patience=0)
    es = ll.EarlyStopping(patience=1, min_delta=-0.5)
    assert es.min_delta == 0.5
    fitter = SimpleNamespace(resumed_from=None)
    es.on_fit_start(fitter, ll.FitState(), Control())
    assert not _es_event(es, 1.0, 1, fitter)
    # 0.8 is lower, but not by more than 0.5: no improvement, patience 1 -> stop
    assert _es_event(es, 0.8, 2, fitter)


def test_early_stopping_counters_restored_by_load_state_dict():
    """A resumed run stops exactly where the uninterrupted one would: best and wait come back."""
    fitter = SimpleNamespace(resumed_from="run/checkpoint-4")
    es = ll.EarlyStopping(patience=3)
    es.load_state_dict({"best": 1.0, "wait": 2, "stopped_step": None})
    es.on_fit_start(fitter, ll.FitState(), Control())
    assert (es.best, es.wait) == (1.0, 2)
    assert _es_event(es, 1.5, 5, fitter)  # the third evaluation without improving on 1.0
    assert es.stopped_step == 5


def test_early_stopping_state_loaded_by_hand_does_not_carry_into_a_fresh_fit():
    """A fresh fit (resumed_from None) counts afresh, even after load_state_dict: a stop recorded
    there must not stop the new run at its start."""
    es = ll.EarlyStopping(patience=3)
    es.load_state_dict({"best": 1.0, "wait": 2, "stopped_step": 4})
    control = Control()
    es.on_fit_start(SimpleNamespace(resumed_from=None), ll.FitState(), control)
    assert not control.should_training_stop
    assert (es.best, es.wait, es.stopped_step) == (None, 0, None)


def test_early_stopping_loaded_state_serves_one_fit_only():
    """Reused: resumed first from a checkpoint with its state, then from one without it, the second
    fit counts afresh."""
    es = ll.EarlyStopping(patience=3)
    es.load_state_dict({"best": 1.0, "wait": 2, "stopped_step": 4})
    control = Control()
    es.on_fit_start(SimpleNamespace(resumed_from="a/checkpoint-4"), ll.FitState(), control)
    assert control.should_training_stop  # resumed at the step it stopped at: stays stopped
    control = Control()
    es.on_fit_start(SimpleNamespace(resumed_from="b/checkpoint-2"), ll.FitState(), control)  # no state loaded
    assert not control.should_training_stop
    assert (es.best, es.wait, es.stopped_step) == (None, 0, None)


def test_a_save_asked_for_while_an_async_checkpoint_commits_is_not_called_late(tmp_path):
    """async_save: the checkpoint of step 2 is committed (and its on_save called) at the next save,
    asked for with should_save in on_step_end of step 3. That flag was set before on_save, not in
    it: no 'ignored' warning, and step 3 is saved."""

    class SaveAt3(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                control.should_save = True

    class Saves(ll.Callback):
        def __init__(self):
            self.paths = []

        def on_save(self, fitter, state, control, path):
            self.paths.append(path.rsplit("-", 1)[-1])

    saves = Saves()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit(tmp_path, [SaveAt3(), saves], max_steps=4, save_every=2, async_save=True).fit(
            Classifier(), DictDataset(n=40))
    assert saves.paths == ["2", "3", "4"]


def test_control_pending_is_true_for_each_flag_alone_and_false_for_none():
    """The loop skips a step boundary with nothing scheduled unless ``Control.pending()``: every
    flag of ``Control`` (a flag added later included) must make it True on its own."""
    import dataclasses

    assert not Control().pending()
    names = [f.name for f in dataclasses.fields(Control)]
    assert len(names) == 5
    for name in names:
        control = Control()
        setattr(control, name, True)
        assert control.pending(), name


@pytest.mark.parametrize(("kw", "values", "stops_at"), [
    (dict(mode="max", stopping_threshold=0.9), [0.5, 0.9, 0.95], 3),  # better than 0.9: above it
    (dict(mode="max", divergence_threshold=0.1), [0.5, 0.6, 0.1, 0.05], 4),  # worse than 0.1: below it
    (dict(mode="min", stopping_threshold=0.2), [0.5, 0.2, 0.1], 3),
    (dict(mode="min", divergence_threshold=3.0, check_finite=False), [1.0, 3.0, float("inf")], 3),
    (dict(mode="min", check_finite=True), [1.0, float("-inf")], 2),
])
def test_early_stopping_thresholds_stop_at_once_in_either_mode(kw, values, stops_at):
    """Lightning's meanings: a threshold is passed strictly (torch.lt / torch.gt), whatever the
    patience; check_finite stops on -inf too (an improvement, were it counted)."""
    es, fitter = ll.EarlyStopping(patience=10, **kw), SimpleNamespace(resumed_from=None)
    es.on_fit_start(fitter, ll.FitState(), Control())
    stops = [_es_event(es, v, step, fitter) for step, v in enumerate(values, start=1)]
    assert stops == [step == stops_at for step in range(1, len(values) + 1)]
    assert es.stopped_step == stops_at


def test_early_stopping_refuses_a_threshold_that_is_not_finite():
    with pytest.raises(ll.ConfigError, match="EarlyStopping stopping_threshold must be a finite number or None, got nan"):
        ll.EarlyStopping(stopping_threshold=float("nan"))

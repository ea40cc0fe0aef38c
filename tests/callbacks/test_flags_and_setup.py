"""Control flags set in the events of a step boundary are spent at that step; a callback state no
resume could load is refused at the first save; ``on_exception`` sees set-up errors with this
fit's callbacks and state (audit round BU)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.errors import CheckpointError, ConfigError, DataError


def _fitter(tmp_path, callbacks, out="run", **kw):
    cfg = dict(batch_size=4, output_dir=str(tmp_path / out), loggers=[], model_summary=False, log_level="error")
    cfg.update(kw)
    return ll.Fitter(callbacks=callbacks, **cfg)


# ---- should_epoch_stop set while the epoch is ending ---------------------------------------------
@pytest.mark.parametrize("event", ["on_evaluate", "on_log"])
def test_epoch_stop_set_in_the_epoch_ends_evaluation_or_row_does_not_cut_the_next_epoch(tmp_path, event):
    """Before: ``_end_epoch`` reset should_epoch_stop right after on_epoch_end, before the epoch
    end's evaluation and log row; a stop set in their on_evaluate / on_log survived into epoch 1
    and cut it to one step (epoch ends at 8, 9, 17; 17 steps instead of 24)."""
    ends = []

    class CB(ll.Callback):
        def on_epoch_end(self, fitter, state, control):
            ends.append(state.global_step)
            if event == "on_log":
                control.should_log = True  # a row at the epoch's end (log_every=100: none otherwise)

    def cut(self, fitter, state, control, metrics):
        if state.global_step == 8:  # the epoch end's evaluation / row of epoch 0 (8 steps per epoch)
            control.should_epoch_stop = True

    setattr(CB, event, cut)
    result = _fitter(tmp_path, [CB()], max_epochs=3, log_every=100, eval_on_epoch_end=True).fit(
        Classifier(), DictDataset(n=32), DictDataset(n=8, seed=1))
    assert ends == [8, 16, 24]
    assert result.global_step == 24


def test_a_run_resumed_after_an_epoch_stop_set_at_the_epoch_end_matches_the_uninterrupted_run(tmp_path):
    """Before: the leaked flag was not in checkpoint-8 (taken at that epoch's end), so the run
    killed after it and resumed trained epoch 1 in full (24 steps) while the uninterrupted run cut
    it to one step (17)."""

    class CutInEpochEndEvaluation(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            if state.global_step == 8:
                control.should_epoch_stop = True

    class Kill(ll.Callback):
        def on_step_start(self, fitter, state, control):
            if state.global_step == 8:
                raise KeyboardInterrupt  # killed after checkpoint-8 was written

    def run(out, callbacks, resume=None):
        return _fitter(tmp_path, callbacks, out=out, max_epochs=3, log_every=100, eval_on_epoch_end=True,
                       save_strategy="epoch").fit(Classifier(), DictDataset(n=32), DictDataset(n=8, seed=1),
                                                  resume=resume)

    whole = run("a", [CutInEpochEndEvaluation()])
    with pytest.raises(KeyboardInterrupt):
        run("b", [CutInEpochEndEvaluation(), Kill()])
    resumed = run("b", [CutInEpochEndEvaluation()], resume=True)
    assert whole.global_step == 24
    assert resumed.global_step == 24


# ---- should_evaluate set in the row an evaluation writes -----------------------------------------
def test_should_evaluate_set_in_the_row_an_evaluation_writes_is_spent_at_that_step(tmp_path):
    """Before: ``_evaluate_all`` reset should_evaluate before writing the row asked for in
    on_evaluate; should_evaluate set in that row's on_log carried into the next step, which
    evaluated and logged again: every step from step 5 on ([5, 6, ..., 12])."""
    evals, logs = [], []

    class LogWithEveryEvaluation(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            evals.append(state.global_step)
            control.should_log = True

    class EvaluateWithEveryRow(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            logs.append(state.global_step)
            control.should_evaluate = True  # this step evaluates anyway, or already did

    _fitter(tmp_path, [LogWithEveryEvaluation(), EvaluateWithEveryRow()], max_steps=12, eval_every=5,
            log_every=100).fit(Classifier(), DictDataset(n=64), DictDataset(n=8, seed=1))
    assert evals == [5, 10, 12]  # eval_every=5 and the last step
    assert logs == [5, 10, 12]


# ---- callbacks.pt must load back as a resume loads it --------------------------------------------
class KeepsState(ll.Callback):
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"kept": self.value}

    def load_state_dict(self, state):
        self.value = state["kept"]


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize(("value", "where", "kind"), [
    (np.float64(0.5), "['kept']", "numpy.float64"),
    ({"history": [1.0, np.int64(3)]}, "['kept']['history'][1]", "numpy.int64"),
    (Pair(1.0, 2.0), "['kept']", "Pair"),
])
def test_a_callback_state_no_resume_could_load_is_refused_at_the_first_save(tmp_path, value, where, kind):
    """Before: callbacks.pt was written with torch.save and read back with weights_only=True, so a
    state holding a numpy scalar (or a namedtuple) was saved without a word, every checkpoint
    verified, and only the resume failed (UnpicklingError). Now the first save refuses it, naming
    the callback, where the value is and its type, and no checkpoint is left behind."""
    fitter = _fitter(tmp_path, [KeepsState(value)], max_steps=4, save_every=2)
    with pytest.raises(CheckpointError) as caught:
        fitter.fit(Classifier(), DictDataset(n=32))
    message = str(caught.value)
    assert f"callback KeepsState: its state_dict(){where} holds a " in message
    assert kind in message and "weights_only=True" in message
    assert fitter.state.global_step == 2  # at the first save
    assert not list((tmp_path / "run").glob("checkpoint-*"))


# ---- on_exception for set-up errors ----------------------------------------------------------------
def test_on_exception_sees_set_up_errors_with_this_fits_callbacks_and_state(tmp_path):
    """Before: ``fit`` built its callbacks and FitState part-way through set-up, and on_exception
    went to ``fitter.callbacks``: an error before that (no training data, eval_every without val,
    resume=True with no checkpoint) reached no callback on a Fitter's first fit, and on a later
    fit the previous fit's callbacks with its old state (global_step 3)."""
    seen = []

    class Watch(ll.Callback):
        def on_exception(self, fitter, state, control, error):
            seen.append((type(error).__name__, state.global_step, state is fitter.state))

    fitter = _fitter(tmp_path, [Watch()], max_steps=3, overwrite_output_dir=True)
    with pytest.raises(DataError, match="the training data is empty"):
        fitter.fit(Classifier(), DictDataset(n=0))  # empty training data, on the first fit
    assert seen == [("DataError", 0, True)]
    fitter.fit(Classifier(), DictDataset(n=16))  # a fit that succeeds (3 steps)
    assert seen == [("DataError", 0, True)]
    seen.clear()
    with pytest.raises(DataError, match="the training data is empty"):
        fitter.fit(Classifier(), DictDataset(n=0))  # the same error again, after a fit of 3 steps
    with pytest.raises(ConfigError, match="eval_every is set but fit.. got no evaluation data"):
        _fitter(tmp_path, [Watch()], out="noval", max_steps=3, eval_every=2).fit(Classifier(), DictDataset(n=16))
    with pytest.raises(CheckpointError, match="holds no valid checkpoint"):
        _fitter(tmp_path, [Watch()], out="empty", max_steps=3).fit(Classifier(), DictDataset(n=16), resume=True)
    assert seen == [("DataError", 0, True), ("ConfigError", 0, True), ("CheckpointError", 0, True)]

"""A callback may return its flags, as in the HF Trainer's docs (``return {"should_training_stop":
True}``) or a ``Control``; anything else is an error naming the callback and the event, instead
of a return value the loop ignores (issue 35)."""

from __future__ import annotations

import pytest
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.callbacks.base import FLAGS
from lightlike.errors import CallbackReturnError


def _fit(tmp_path, callback, **kw):
    cfg = dict(max_steps=8, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False,
               save_strategy="no", progress_bar=False, log_level="error")
    cfg.update(kw)
    return ll.Fitter(callbacks=[callback], **cfg).fit(Classifier(), DictDataset(n=16), **(
        {"val": DictDataset(n=4, seed=1)} if "eval_every" in kw else {}))


class Returns(ll.Callback):
    """Returns ``value`` from on_step_end at step ``at`` (None before)."""

    def __init__(self, value, at=3):
        self.value, self.at = value, at

    def on_step_end(self, fitter, state, control):
        return self.value if state.global_step == self.at else None


def test_hf_names_and_controls_returned_stop_the_run_at_that_step(tmp_path):
    assert FLAGS == ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
    assert _fit(tmp_path, Returns({"should_training_stop": True})).global_step == 3
    assert _fit(tmp_path, Returns(ll.Control(should_training_stop=True))).global_step == 3
    assert _fit(tmp_path, Returns({})).global_step == 8  # the HF docs' `return {}`: no flag
    assert _fit(tmp_path, Returns(ll.Control())).global_step == 8

    class Evaluated(ll.Callback):  # returned from on_evaluate, the flag counts at the same step
        def on_evaluate(self, fitter, state, control, metrics):
            return {"should_training_stop": True} if state.global_step == 4 else None

    assert _fit(tmp_path, Evaluated(), eval_every=2).global_step == 4

    class SetsAndReturns(ll.Callback):  # the HF idiom: set the flag, return the control received
        def on_step_end(self, fitter, state, control):
            control.should_training_stop = state.global_step == 5
            return control

    assert _fit(tmp_path, SetsAndReturns()).global_step == 5


def test_save_and_log_returned_are_acted_on(tmp_path):
    """``{"should_save": True}`` at step 2 writes checkpoint-2 with save_strategy='no';
    ``{"should_log": True}`` at step 3 writes a row there with log_every=100."""
    class Asks(ll.Callback):
        def on_step_end(self, fitter, state, control):
            return {2: {"should_save": True}, 3: {"should_log": True, "should_save": False}}.get(state.global_step)

    result = _fit(tmp_path, Asks(), max_steps=4, log_every=100)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    assert [row["step"] for row in result.state.log_history if "train/loss" in row] == [3, 4]


@pytest.mark.parametrize(("value", "message"), [
    (True, r"^Returns\.on_step_end returned True \(bool\): a callback returns None, a Control, or a mapping of "
           r"flag names to True/False such as \{'should_training_stop': True\}; or set the flag on control$"),
    ({"should_evalute": True}, r"^Returns\.on_step_end returned the flag 'should_evalute', which is not one \(did you "
                            r"mean 'should_evaluate'\?\); the flags are: should_training_stop, should_epoch_stop, "
                            r"should_save, should_evaluate, should_log$"),
    ({"should_training_stop": 1}, r"^Returns\.on_step_end returned should_training_stop=1 \(int\): a flag is "
                                  r"True or False; write \{'should_training_stop': True\}$"),
])
def test_anything_else_returned_is_an_error_naming_the_callback_and_event(tmp_path, value, message):
    with pytest.raises(CallbackReturnError, match=message):
        _fit(tmp_path, Returns(value, at=1))

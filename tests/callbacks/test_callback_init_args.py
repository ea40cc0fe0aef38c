"""A callback's saved state comes back only into a callback built with the same arguments
(``init_args``), as the HF Trainer's ExportableState compares them; otherwise the new one keeps
its arguments, starts afresh, and a warning names the arguments that changed."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import Classifier, DictDataset, StopAt

import lightlike as ll


class Scores(Classifier):
    """val/score of the n-th evaluation is ``values[n]``."""

    values = [5.0, 4.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0]

    def __init__(self):
        super().__init__()
        self.evals = 0

    def metrics(self, outputs, batch):
        return {"score": torch.tensor(self.values[self.evals])}


class Count(ll.Callback):
    def on_evaluate(self, fitter, state, control, metrics):
        fitter.module.evals += 1  # (a resumed run's module is given the count of its checkpoint's step)


def go(out, es, kill=None, resume=None, evals=0):
    torch.manual_seed(0)
    module = Scores()
    module.evals = evals
    callbacks = [es, Count()] + ([StopAt(kill)] if kill else [])
    f = ll.Fitter(max_steps=8, eval_every=1, save_every=1, batch_size=4, output_dir=str(out), loggers=[],
                  model_summary=False, callbacks=callbacks)
    with contextlib.suppress(KeyboardInterrupt):
        return f.fit(module, DictDataset(n=40), DictDataset(n=4, seed=1), resume=resume)
    return None


def test_early_stopping_state_restored_only_with_the_same_arguments(tmp_path):
    """Scores 5, 4, 6, 6, ...: the best is 4 (step 2); patience=3 stops at step 5. Killed at step
    4 (resumed from step 3: wait 1), the same EarlyStopping stops at 5 too; one built with
    patience=4 keeps patience 4, counts afresh from step 4 (wait 0, no best), and says why."""
    ref = go(tmp_path / "ref", ll.EarlyStopping("val/score", patience=3))
    assert ref.global_step == 5
    go(tmp_path / "cut", ll.EarlyStopping("val/score", patience=3), kill=4)
    same = ll.EarlyStopping("val/score", patience=3)
    result = go(tmp_path / "cut", same, resume=True, evals=3)
    assert result.global_step == 5 and same.best == 4.0

    go(tmp_path / "cut2", ll.EarlyStopping("val/score", patience=3), kill=4)
    other = ll.EarlyStopping("val/score", patience=4)
    with pytest.warns(UserWarning, match=r"the checkpoint holds the state of EarlyStopping \(EarlyStopping\[val/score\]\) "
                                         r"built with other arguments \(patience=3 -> 4\): it is not restored"):
        result = go(tmp_path / "cut2", other, resume=True, evals=3)
    # afresh from step 4: best 6.0 there, then 4 evaluations without improvement: steps 5..8
    assert other.patience == 4 and other.best == 6.0 and result.global_step == 8


def test_a_callback_without_init_args_is_restored_as_before():
    from lightlike.callbacks.base import ARGS_KEY, CallbackList

    class Keeps(ll.Callback):
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    saved = CallbackList([Keeps(), ll.EarlyStopping(patience=2)])
    saved.callbacks[0].n = 7
    saved.callbacks[1].wait = 1
    state = saved.state_dict()
    assert state[ARGS_KEY] == {"EarlyStopping[val/loss]": ll.EarlyStopping(patience=2).init_args()}
    fresh = CallbackList([Keeps(), ll.EarlyStopping(patience=2)])
    fresh.load_state_dict(state)
    assert fresh.callbacks[0].n == 7 and fresh.callbacks[1].wait == 1
    older = {k: v for k, v in state.items() if k != ARGS_KEY}  # a checkpoint written before init_args
    fresh = CallbackList([Keeps(), ll.EarlyStopping(patience=5)])
    fresh.load_state_dict(older)
    assert fresh.callbacks[1].wait == 1

"""Callback events in order, control flags, EarlyStopping, callback state."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.callbacks import EVENTS


class Recorder(ll.Callback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name in EVENTS:
            def record(fitter, state, control, *args):
                self.events.append((name, state.global_step))
            return record
        return super().__getattribute__(name)


def fit(tmp_path, callbacks, **kw):
    cfg = dict(batch_size=4, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False,
               shuffle=False, learning_rate=1e-2)
    cfg.update(kw)
    return ll.Fitter(callbacks=callbacks, **cfg)


def test_event_order(tmp_path):
    rec = Recorder()
    data, val = DictDataset(n=12), DictDataset(n=6, seed=1)
    fit(tmp_path, [rec], max_epochs=1, grad_accum_steps=2, log_every=1, eval_every=1).fit(Classifier(), data, val)
    # 12 items / batch 4 = 3 batches; accumulation 2 -> steps of 2 and 1 micro-batches
    # 6 evaluation items / batch 4 -> 2 evaluation batches
    step = lambda s: [("on_step_start", s - 1), ("on_before_optimizer_step", s - 1),  # noqa: E731
                      ("on_step_end", s), ("on_log", s), ("on_eval_batch_end", s), ("on_eval_batch_end", s),
                      ("on_evaluate", s)]
    expected = [("on_fit_start", 0), ("on_epoch_start", 0), *step(1), *step(2),
                ("on_epoch_end", 2), ("on_save", 2), ("on_fit_end", 2)]  # the fit's last step is saved
    assert rec.events == expected


@pytest.mark.parametrize("data", ["map", "iterable"])
def test_every_epoch_ends_in_the_same_order(tmp_path, data):
    """With an evaluation and a save at every epoch's end, each epoch's boundary runs log,
    evaluate, end epoch, save, in that order, the last epoch's as every other's (the last one
    evaluated before on_epoch_end, the others after it); also where the epoch ends because the
    data ran out (an iterable dataset of unknown length)."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return (DictDataset(n=12)[i] for i in range(12))

    class ThirdEpochEnds(ll.Callback):  # an iterable's epochs are not counted in advance
        def on_epoch_end(self, fitter, state, control):
            control.should_training_stop = state.epoch_index == 2

    rec = Recorder()
    train = DictDataset(n=12) if data == "map" else Stream()
    budget = {"max_epochs": 3} if data == "map" else {"max_steps": 100}
    fit(tmp_path, [ThirdEpochEnds(), rec], log_every=3, eval_on_epoch_end=True, save_strategy="epoch", **budget).fit(
        Classifier(), train, DictDataset(n=6, seed=1))
    boundary = [e for e in rec.events if e[0] in ("on_log", "on_evaluate", "on_epoch_end", "on_save")]
    assert boundary == [(event, s) for s in (3, 6, 9) for event in ("on_log", "on_evaluate", "on_epoch_end", "on_save")]


def test_exception_event(tmp_path):
    rec = Recorder()

    class Boom(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 2:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, [rec, Boom()], max_steps=5).fit(Classifier(), DictDataset(n=40))
    assert rec.events[-1] == ("on_exception", 2)


def test_control_flags(tmp_path):
    seen = {}

    class Steer(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 2:
                control.should_log = True
                control.should_evaluate = True
                control.should_save = True
            if state.global_step == 4:
                control.should_epoch_stop = True
            if state.global_step == 6:
                control.should_training_stop = True

        def on_epoch_start(self, fitter, state, control):
            seen.setdefault("epoch_starts", []).append(state.global_step)

    rec = Recorder()
    result = fit(tmp_path, [Steer(), rec], max_steps=100, log_every=1000).fit(
        Classifier(), DictDataset(n=40), DictDataset(n=8, seed=2))
    assert result.global_step == 6
    assert ("on_log", 2) in rec.events and ("on_evaluate", 2) in rec.events and ("on_save", 2) in rec.events
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    # 10 batches per epoch; should_epoch_stop at step 4 starts epoch 1 early
    assert seen["epoch_starts"] == [0, 4]
    assert result.state.epoch_index == 1


@pytest.mark.parametrize("event", ["on_step_end", "on_log", "on_evaluate"])
def test_epoch_stop_acts_at_the_step_whichever_event_sets_it(tmp_path, event):
    """As in the HF Trainer, flags set while the step boundary's log and evaluation run are acted
    on at that step: the epoch ends at step 2, not a step later. 20 items, batch 3, accumulation 2:
    4 steps per epoch, 2 epochs -> epoch 0 cut at step 2, epoch 1 takes 4 more."""
    ends = []

    class CutAtStep2(ll.Callback):
        def on_epoch_end(self, fitter, state, control):
            ends.append(state.global_step)

    def cut(self, fitter, state, control, *args):
        if state.global_step == 2 and state.epoch_index == 0:
            control.should_epoch_stop = True

    setattr(CutAtStep2, event, cut)
    result = fit(tmp_path, [CutAtStep2()], max_epochs=2, batch_size=3, grad_accum_steps=2, eval_every=2,
                 log_every=2).fit(Classifier(), DictDataset(n=20), DictDataset(n=6, seed=1))
    assert ends == [2, 6] and result.global_step == 6


def test_a_stop_set_at_an_epoch_end_logs_and_evaluates_before_its_checkpoint(tmp_path):
    class StopAtFirstEpochEnd(ll.Callback):
        def on_epoch_end(self, fitter, state, control):
            control.should_training_stop = True

    rec = Recorder()
    fit(tmp_path, [StopAtFirstEpochEnd(), rec], max_epochs=3, log_every=100, save_every=100, eval_every=100).fit(
        Classifier(), DictDataset(n=12), DictDataset(n=6, seed=1))
    tail = [e for e in rec.events if e[0] in ("on_log", "on_evaluate", "on_save", "on_epoch_end")]
    assert tail == [("on_epoch_end", 3), ("on_log", 3), ("on_evaluate", 3), ("on_save", 3)]


def test_early_stopping(tmp_path):
    class WorseAndWorse(Classifier):
        """Evaluation loss that rises after the second evaluation."""
        def __init__(self):
            super().__init__()
            self.evals = 0

        def metrics(self, outputs, batch):
            return {"score": torch.tensor(float(self.evals))}

    class Count(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            fitter.module.evals += 1

    es = ll.EarlyStopping(monitor="val/score", patience=2, mode="max")
    # score per eval: 0, 1, 2, ... strictly increasing -> never stops with mode max
    r = fit(tmp_path / "a", [Count(), es], max_steps=10, eval_every=1).fit(
        WorseAndWorse(), DictDataset(n=40), DictDataset(n=4))
    assert r.global_step == 10 and es.wait == 0
    # with mode min the first value (0) is best; evals 2 and 3 do not improve -> stop at step 3
    es = ll.EarlyStopping(monitor="val/score", patience=2, mode="min")
    r = fit(tmp_path / "b", [Count(), es], max_steps=10, eval_every=1).fit(
        WorseAndWorse(), DictDataset(n=40), DictDataset(n=4))
    assert r.global_step == 3 and es.stopped_step == 3
    assert es.state_dict() == {"best": 0.0, "wait": 2, "stopped_step": 3}


def test_early_stopping_min_delta(tmp_path):
    """Scores 0, 0.2, 0.4, ... (mode max), patience 2. An improvement must exceed the best so
    far by more than min_delta: with 0.5, evaluations 2 and 3 do not, so training stops at step
    3; with 0.3 every second evaluation does (0.4 > 0 + 0.3, 0.8 > 0.4 + 0.3, ...): no stop."""
    class Rising(Classifier):
        evals = 0

        def metrics(self, outputs, batch):
            return {"score": torch.tensor(0.2 * self.evals, dtype=torch.float64)}

    class Count(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            fitter.module.evals += 1

    for delta, steps, best in ((0.5, 3, 0.0), (0.3, 8, 1.2)):
        es = ll.EarlyStopping(monitor="val/score", patience=2, mode="max", min_delta=delta)
        r = fit(tmp_path / str(delta), [Count(), es], max_steps=8, eval_every=1).fit(
            Rising(), DictDataset(n=40), DictDataset(n=4))
        assert r.global_step == steps, delta
        assert es.best == pytest.approx(best), delta


def test_early_stopping_unknown_metric(tmp_path):
    es = ll.EarlyStopping(monitor="val/acc")
    with pytest.raises(ll.ConfigError, match="val/accuracy"):
        fit(tmp_path, [es], max_steps=2, eval_every=1).fit(Classifier(), DictDataset(n=8), DictDataset(n=4))


def test_a_stop_set_in_on_save_ends_the_run_at_that_checkpoint(tmp_path):
    """on_save comes after the step's checkpoint. A stop set there ("stop once a checkpoint is on
    disk") used to log and evaluate the step after its checkpoint, which still held those losses
    as pending: the resumed run logged steps 5-6 a second time. The checkpoint is now the run's
    last record: the losses stay pending in it (the result counts them), and a resumed run
    logs exactly what the uninterrupted one does."""
    import json

    class StopOnSave(ll.Callback):
        def on_save(self, fitter, state, control, path):
            if state.global_step == 6:
                control.should_training_stop = True

    def run(out, callbacks, max_steps=12, resume=None):
        return ll.Fitter(output_dir=str(out), loggers=["jsonl"], model_summary=False, log_level="error",
                         max_steps=max_steps, lr_scheduler="constant", log_every=4, save_every=6, eval_every=4,
                         batch_size=8, callbacks=callbacks).fit(
            Classifier(), DictDataset(64), DictDataset(16, seed=1), resume=resume)

    stopped = run(tmp_path / "a", [StopOnSave()])
    assert stopped.global_step == 6
    assert [h["step"] for h in stopped.state.log_history] == [4, 4]  # nothing after the checkpoint
    saved = json.loads((tmp_path / "a" / "checkpoint-6" / "trainer_state.json").read_text())
    assert len(saved["pending_per_rank"][0]) == 2 and saved["state"]["last_eval_step"] == 4
    # the result's loss counts steps 5-6: the same as a run of 6 steps (constant lr: the same steps)
    assert stopped.training_loss == pytest.approx(run(tmp_path / "six", [], max_steps=6).training_loss, rel=1e-12)
    resumed = run(tmp_path / "a", [], resume=True)
    reference = run(tmp_path / "ref", [])
    rows = lambda out: (out / "logs" / "metrics.jsonl").read_text()  # noqa: E731
    assert rows(tmp_path / "a") == rows(tmp_path / "ref")  # every step once, the same values
    assert resumed.training_loss == pytest.approx(reference.training_loss, rel=1e-12)


def test_a_stop_at_the_end_of_an_iterable_epoch_logs_and_evaluates_before_its_checkpoint(tmp_path):
    """An IterableDataset's epoch ends when a step finds no batch; that path saved straight after
    on_epoch_end, before the pending losses were logged and the step evaluated."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __init__(self):
            self.data = DictDataset(20)

        def __iter__(self):
            return (self.data[i] for i in range(20))

    class StopAtEpochEnd(ll.Callback):
        def on_epoch_end(self, fitter, state, control):
            control.should_training_stop = True

    rec = Recorder()
    fit(tmp_path, [StopAtEpochEnd(), rec], max_steps=10, batch_size=8, log_every=100, save_strategy="epoch").fit(
        Classifier(), Stream(), DictDataset(8, seed=1))
    tail = [e for e in rec.events if e[0] in ("on_log", "on_evaluate", "on_save", "on_epoch_end")]
    assert tail == [("on_epoch_end", 3), ("on_log", 3), ("on_evaluate", 3), ("on_save", 3)]


def test_flags_asked_for_again_in_their_own_event_do_not_carry_into_the_next_step(tmp_path):
    """should_log set in on_evaluate is acted on at that step; a flag set again in the event of
    its own action (should_log in on_log, should_evaluate in on_evaluate, should_save in on_save,
    should_epoch_stop in on_epoch_end) is spent there, as in the HF Trainer, instead of acting a
    step late (should_epoch_stop cut the next epoch to one step). Flags set in on_save, after the
    checkpoint, are dropped with a warning: acting on them later would make a killed and resumed
    run differ (the checkpoint cannot hold them)."""

    class Again(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            control.should_log = True

        def on_evaluate(self, fitter, state, control, metrics):
            control.should_evaluate = True
            control.should_log = state.global_step == 3

        def on_save(self, fitter, state, control, path):
            control.should_save = True  # spent: this is the step's checkpoint
            control.should_epoch_stop = True  # the checkpoint cannot hold it: dropped (and said)

        def on_epoch_end(self, fitter, state, control):
            control.should_epoch_stop = True

    rec = Recorder()
    # 32 items, batch 4: 8 steps per epoch, 2 epochs
    with pytest.warns(UserWarning, match="should_save, control.should_epoch_stop set in Again.on_save is ignored") as w:
        result = fit(tmp_path, [Again(), rec], max_epochs=2, log_every=4, eval_every=3, save_every=5).fit(
            Classifier(), DictDataset(n=32), DictDataset(n=8, seed=1))
    late = [x for x in w if "on_save is ignored" in str(x.message)]
    # the warning points at the callback's on_save (where the flag was set), not into lightlike
    assert {(x.filename, x.lineno) for x in late} == {(__file__, Again.on_save.__code__.co_firstlineno)}
    assert result.global_step == 16
    events = lambda name: [s for e, s in rec.events if e == name]  # noqa: E731
    assert events("on_log") == [3, 4, 8, 12, 16]
    assert events("on_evaluate") == [3, 6, 9, 12, 15, 16]
    assert events("on_save") == [5, 10, 15, 16]
    assert events("on_epoch_end") == [8, 16]


def test_should_evaluate_without_evaluation_data_is_an_error(tmp_path):
    class Evaluate(ll.Callback):
        def on_step_end(self, fitter, state, control):
            control.should_evaluate = state.global_step == 2

    with pytest.raises(ll.ConfigError, match="should_evaluate was set .* no evaluation data"):
        fit(tmp_path, [Evaluate()], max_steps=4).fit(Classifier(), DictDataset(n=32))


def test_callbacks_sharing_a_state_key_are_refused_when_the_fit_starts(tmp_path):
    """The clash was found at the first save, after training (and a preemption save was lost)."""

    class Counter(ll.Callback):
        def state_dict(self):
            return {"n": 1}

    with pytest.raises(ll.ConfigError, match="share state_key 'Counter'"):
        fit(tmp_path, [Counter(), Counter()], max_steps=2).fit(Classifier(), DictDataset(n=16))
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_reused_early_stopping_counts_afresh_on_a_checkpoint_without_its_state(tmp_path):
    """An instance that stopped one run, reused to resume another run saved without it, kept its
    stopped_step and ended the resumed run at once."""
    def run(out, callbacks, max_steps=12, resume=None):
        return ll.Fitter(output_dir=str(out), loggers=[], log_level="error", model_summary=False, max_steps=max_steps,
                         eval_every=2, save_every=2, batch_size=8, callbacks=callbacks).fit(
            Classifier(), DictDataset(64), DictDataset(16, seed=1), resume=resume)

    es = ll.EarlyStopping("val/loss", patience=1, min_delta=10.0)  # stops at the second evaluation
    assert run(tmp_path / "a", [es]).global_step == 4 and es.stopped_step == 4
    run(tmp_path / "b", [], max_steps=4)
    assert run(tmp_path / "b", [es], resume=True).global_step == 8  # two more evaluations, not 0 steps
    assert es.stopped_step == 8


def test_callbacks_are_called_in_the_order_given(tmp_path):
    """Every event calls the callbacks in the order passed (calling them reversed passed the suite:
    the order test used a single callback)."""
    calls = []

    class Named(ll.Callback):
        def __init__(self, name):
            self.name = name

        def on_fit_start(self, fitter, state, control):
            calls.append(("fit_start", self.name))

        def on_step_end(self, fitter, state, control):
            calls.append(("step_end", self.name))

    ll.Fitter(max_steps=2, batch_size=4, output_dir=str(tmp_path), loggers=[], model_summary=False,
              callbacks=[Named("a"), Named("b"), Named("c")]).fit(Classifier(), DictDataset(n=8))
    assert calls == [("fit_start", n) for n in "abc"] + [("step_end", n) for n in "abc"] * 2


def test_a_nan_metric_never_counts_as_an_improvement():
    """With check_finite=False: NaN at the first evaluation became the best (no best yet), and
    nothing beats NaN: EarlyStopping then stopped after `patience` evaluations that were all
    improvements. With check_finite=True (the default, as Lightning's) NaN stops at once."""
    from lightlike.evaluation import is_improvement

    assert not is_improvement(float("nan"), None, greater_is_better=False)
    stopper, control = ll.EarlyStopping(monitor="val/loss", patience=2, check_finite=False), ll.Control()
    state = ll.FitState()
    for step, value in enumerate([float("nan"), 0.9, 0.8, 0.7], start=1):
        state.global_step = step
        stopper.on_evaluate(None, state, control, {"val/loss": value})
    assert not control.should_training_stop and stopper.best == 0.7
    stopper = ll.EarlyStopping(monitor="val/loss", patience=2)
    stopper.on_evaluate(None, state, control, {"val/loss": float("nan")})
    assert control.should_training_stop and stopper.stopped_step == 4


def test_a_fresh_control_returned_clears_no_flag_another_callback_set(tmp_path):
    """At step 3's on_step_end one callback sets ``control.should_save``; the next returns a fresh
    ``Control(should_training_stop=True)``: both act (a checkpoint of step 3, and the fit stops
    there). A merge that copied every flag of the returned Control would clear the save."""
    class Save(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                control.should_save = True

    class Stop(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                return ll.Control(should_training_stop=True)

    result = fit(tmp_path, [Save(), Stop()], max_steps=8, save_strategy="no").fit(Classifier(), DictDataset(n=40))
    assert result.global_step == 3
    assert (tmp_path / "run" / "checkpoint-3" / "manifest.json").is_file()


def test_a_lightning_or_hf_hook_lightlike_never_calls_is_warned_about_and_a_non_callback_refused(tmp_path):
    """A callback ported from Lightning (``on_train_batch_end``) or the HF Trainer
    (``on_step_begin``) would silently never run: each such method is warned about, naming the
    event that takes its place; ``callbacks=[object()]`` (or a class) is one ConfigError."""
    class Ported(ll.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            raise AssertionError("never called")

        def on_step_begin(self, args, state, control, **kwargs):
            raise AssertionError("never called")

        def on_after_backward(self, trainer, pl_module):
            raise AssertionError("never called")

    with pytest.warns(UserWarning) as caught:
        fit(tmp_path, [Ported()], max_steps=1).fit(Classifier(), DictDataset(n=8))
    said = [str(w.message) for w in caught]
    assert any("Ported.on_train_batch_end is a Lightning / HF Trainer hook that lightlike never calls: override "
               "on_step_end(fitter, state, control) instead" in m for m in said), said
    assert any("Ported.on_step_begin" in m and "on_step_start(fitter, state, control)" in m for m in said), said
    assert any("Ported.on_after_backward" in m and "no such event" in m for m in said), said
    for bad, what in ((object(), "callbacks= holds an instance of object, not a lightlike Callback"),
                      (ll.EarlyStopping, "callbacks= holds a class, not an instance: pass EarlyStopping\\(\\)")):
        with pytest.raises(ll.ConfigError, match=what):
            fit(tmp_path, [bad], max_steps=1, overwrite_output_dir=True).fit(Classifier(), DictDataset(n=8))

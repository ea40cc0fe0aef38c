"""limit_train_batches / limit_val_batches against a hand-written loop over exactly those
batches; a kill and resume mid-epoch of a limited run, bit for bit; min_epochs / min_steps kept
over a resume; the settings' errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import Classifier, DictDataset, StopAt, flat_params
from torch.utils.data import DataLoader, IterableDataset

import lightlike as ll
from lightlike.errors import ConfigError


def hand_loop(model, data, *, epochs, per_epoch, batch_size, lr, seed, accum=1):
    """Fused AdamW, linear decay to 0 over every step, each epoch's order the permutation of
    seed + epoch (lightlike's documented order), and only its first ``per_epoch`` batches, taken
    ``accum`` to a step (the epoch's last step takes what is left), each loss weighted by its
    share of the step's items."""
    steps = epochs * -(-per_epoch // accum)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    torch.manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
        batches = list(DataLoader(torch.utils.data.Subset(data, order.tolist()), batch_size=batch_size))[:per_epoch]
        for start in range(0, per_epoch, accum):
            window = batches[start:start + accum]
            items = sum(len(b["y"]) for b in window)
            for batch in window:
                (model.loss(model(batch), batch) * (len(batch["y"]) / items)).backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


def run(tmp_path, limit, **kw):
    torch.manual_seed(7)
    model = Classifier()
    cfg = dict(max_epochs=3, limit_train_batches=limit, batch_size=4, learning_rate=1e-2, seed=3,
               output_dir=str(tmp_path), loggers=[], model_summary=False, log_every=1)
    cfg.update(kw)
    return model, ll.Fitter(**cfg)


@pytest.mark.parametrize(("limit", "per_epoch", "accum"), [(3, 3, 1), (0.5, 5, 1), (1.0, 10, 1), (100, 10, 1),
                                                      (3, 3, 2), (0.5, 5, 2)])
def test_limit_train_batches_trains_on_exactly_those_batches(tmp_path, limit, per_epoch, accum):
    """40 items in batches of 4: 10 batches an epoch; an int is a count, a float the fraction
    int(10 * f), as Lightning's; each epoch ends there (with accumulation, its last step takes the
    batches left below the limit), and max_epochs counts those steps."""
    data = DictDataset(n=40)
    model, f = run(tmp_path, limit, grad_accum_steps=accum)
    result = f.fit(model, data)
    torch.manual_seed(7)
    ref = Classifier()
    hand_loop(ref, data, epochs=3, per_epoch=per_epoch, batch_size=4, lr=1e-2, seed=3, accum=accum)
    steps = -(-per_epoch // accum)
    assert result.global_step == 3 * steps and result.state.epoch_index == 3
    assert torch.equal(flat_params(model), flat_params(ref))
    epochs = [h["train/epoch"] for h in result.state.log_history if "train/epoch" in h]
    assert epochs[steps - 1] == 1.0 and epochs[-1] == 3.0


def test_a_limited_epoch_killed_mid_way_resumes_bit_for_bit(tmp_path):
    """Killed at step 5 (epoch 1, its second batch of 3), resumed from the checkpoint of step 4:
    the same weights and log rows as the run that was never killed."""
    data = DictDataset(n=40)
    model, f = run(tmp_path / "ref", 3, save_every=1, shuffle=True)
    ref = f.fit(model, data)
    cut_model, f = run(tmp_path / "cut", 3, save_every=1, shuffle=True)
    f.user_callbacks = [StopAt(5)]
    with contextlib.suppress(KeyboardInterrupt):
        f.fit(cut_model, data)
    resumed_model, f = run(tmp_path / "cut", 3, save_every=1, shuffle=True)
    result = f.fit(resumed_model, data, resume=True)
    assert f.resumed_from.endswith("checkpoint-4")
    assert result.global_step == ref.global_step == 9
    assert torch.equal(flat_params(resumed_model), flat_params(model))
    rows = lambda r: [(h["step"], h["train/loss"], h["train/epoch"]) for h in r.state.log_history]  # noqa: E731
    assert rows(result) == rows(ref)


def test_limit_val_batches_evaluates_the_first_batches_of_each_set(tmp_path):
    """The val loss of a limit of 2 batches of 4 is the mean over the set's first 8 items,
    computed here by hand; a fraction 0.5 of 3 batches is int(1.5) = 1 batch."""
    torch.manual_seed(0)
    model, val = Classifier(), DictDataset(n=12, seed=1)
    for limit, items in ((2, 8), (0.5, 4), (None, 12)):
        metrics = ll.Fitter(limit_val_batches=limit, batch_size=4, loggers=[], output_dir=str(tmp_path)).validate(
            model, val)
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(model.net(val.x[:items]), val.y[:items])
        assert metrics["val/loss"] == pytest.approx(want.item(), rel=1e-6)


def test_limit_val_batches_in_a_fit_and_zero_evaluates_nothing(tmp_path):
    seen = []

    class Batches(ll.Callback):
        def on_eval_batch_end(self, fitter, state, control, name, batch, num_batches):
            seen.append((state.global_step, batch, num_batches))

    _, f = run(tmp_path / "a", 1, max_epochs=2, eval_every=1, limit_val_batches=2, callbacks=None)
    f.user_callbacks = [Batches()]
    f.fit(Classifier(), DictDataset(n=40), DictDataset(n=20, seed=1))
    assert seen == [(1, 0, 2), (1, 1, 2), (2, 0, 2), (2, 1, 2)]
    _, f = run(tmp_path / "b", 1, max_epochs=2, eval_every=1, limit_val_batches=0)
    result = f.fit(Classifier(), DictDataset(n=40), DictDataset(n=20, seed=1))
    assert result.global_step == 2 and not any("val/loss" in h for h in result.state.log_history)


class Stream(IterableDataset):
    def __init__(self, n):
        self.data = DictDataset(n)

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def test_an_int_limit_gives_an_iterable_dataset_epochs_and_a_fraction_is_refused(tmp_path):
    _, f = run(tmp_path / "a", 2, max_epochs=3)
    assert f.fit(Classifier(), Stream(40)).global_step == 6
    _, f = run(tmp_path / "b", 0.5, max_epochs=3)
    with pytest.raises(ConfigError, match=r"limit_train_batches=0.5 is a fraction of the training batches, whose "
                                          r"number is not known"):
        f.fit(Classifier(), Stream(40))


@pytest.mark.parametrize(("kw", "match"), [
    (dict(limit_train_batches=0), "limit_train_batches=0 trains on nothing"),
    (dict(limit_train_batches=1.5), r"limit_train_batches must be a number of batches \(an int >= 0\) or a fraction"),
    (dict(limit_val_batches=-1), "limit_val_batches must be a number of batches"),
    (dict(limit_val_batches=0, metric_for_best="val/loss"), "limit_val_batches=0 evaluates nothing, so "
                                                           "metric_for_best='val/loss' never has a value"),
    (dict(min_steps=20, max_steps=10), "min_steps=20 is more than max_steps=10"),
    (dict(min_epochs=4, max_epochs=3), "min_epochs=4 is more than max_epochs=3"),
    (dict(min_epochs=-1), "min_epochs must be an int >= 0"),
])
def test_bad_limits_and_minimums_are_one_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        ll.FitConfig(**kw)


def test_a_fraction_below_one_batch_is_refused_before_any_step(tmp_path):
    _, f = run(tmp_path, 0.05)  # 0.05 of 10 batches
    with pytest.raises(ConfigError, match=r"limit_train_batches=0.05 of the 10 training batches of this process is "
                                          r"less than one batch: raise it to at least 0.1"):
        f.fit(Classifier(), DictDataset(n=40))


class StopOnceAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_a_stop_held_by_min_epochs_is_kept_over_a_kill_and_resume(tmp_path):
    """Asked for once at step 2, held until 5 epochs of 2 batches are done (step 10): the run
    killed at step 7 and resumed (from step 6's checkpoint, where nobody asks again) stops at 10."""
    def go(out, callbacks, resume=None):
        torch.manual_seed(0)
        model = Classifier()
        f = ll.Fitter(max_epochs=50, min_epochs=5, limit_train_batches=2, batch_size=4, save_every=2,
                      output_dir=str(out), loggers=[], model_summary=False, callbacks=callbacks)
        with contextlib.suppress(KeyboardInterrupt):
            return model, f.fit(model, DictDataset(n=40), resume=resume)
        return model, None

    model, ref = go(tmp_path / "ref", [StopOnceAt(2)])
    assert ref.global_step == 10
    go(tmp_path / "cut", [StopOnceAt(2), StopAt(7)])
    resumed, result = go(tmp_path / "cut", [], resume=True)
    assert result.global_step == 10 and torch.equal(flat_params(resumed), flat_params(model))


def test_limits_count_each_process_batches_on_two_ranks(tmp_path):
    """torchrun, 2 processes (gloo). Training: 2 batches an epoch on each rank, 2 epochs: 4 steps.
    Evaluation: the set of 30 is dealt round-robin, 15 items (5 batches of 3) to each rank; a limit
    of 2 batches evaluates each rank's first 6, together items 0..11 (mean index 5.5); 0.5 of 5
    batches is int(2.5) = 2 batches, the same items."""
    import json
    from pathlib import Path

    from launching import launch

    p = launch(2, tmp_path, script=Path(__file__).parents[1] / "scripts" / "limits_target.py")
    assert p.returncode == 0, p.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["steps"] == [[1, 0, 1], [2, 0, 2], [3, 1, 1], [4, 1, 2]] and got["global_step"] == 4
        assert got["fit_index"] == got["validate_index"] == 5.5


def test_early_stopping_held_by_min_steps_resumes_held_without_saying_it_stays_stopped(tmp_path, caplog):
    """EarlyStopping asks to stop at step 2 (its metric never improves: learning rate 0) and
    min_steps=8 holds it; killed at step 5 and resumed from step 4's checkpoint, the run goes on to
    step 8, as the uninterrupted one, without the warning of a run resumed where it was stopped."""
    def go(out, kill=None, resume=None):
        torch.manual_seed(0)
        model = Classifier()
        f = ll.Fitter(max_steps=30, min_steps=8, eval_every=1, save_every=2, batch_size=4, learning_rate=0.0,
                      output_dir=str(out), loggers=[], model_summary=False,
                      callbacks=[ll.EarlyStopping(patience=1)] + ([StopAt(kill)] if kill else []))
        with contextlib.suppress(KeyboardInterrupt):
            return f.fit(model, DictDataset(n=40), DictDataset(n=8, seed=1), resume=resume)
        return None

    assert go(tmp_path / "ref").global_step == 8
    go(tmp_path / "cut", kill=5)
    assert go(tmp_path / "cut", resume=True).global_step == 8
    assert "the run stays stopped" not in caplog.text

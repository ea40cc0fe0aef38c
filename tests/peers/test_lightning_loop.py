"""Lightning's own tests of min_epochs / min_steps and of EarlyStopping's thresholds, ported with
their numbers. Lightning's BoringModel trains on 64 items in batches of 2 (32 batches an epoch);
the same shapes are used here. Where Lightning's EarlyStopping checks a training metric at the
training epoch's end, lightlike's (which follows evaluations) watches an evaluation at each
epoch's end (``eval_on_epoch_end``): the stops fall at the same epochs."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import Classifier, DictDataset

import lightlike as ll


def fitter(tmp_path, callbacks, **kw):
    cfg = dict(batch_size=2, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False,
               save_strategy="no")
    cfg.update(kw)
    return ll.Fitter(callbacks=callbacks, **cfg)


class Counts(ll.Callback):
    """Each training step's (epoch, whether a stop was asked for): Lightning's trainer.should_stop,
    which stays set while min_epochs / min_steps hold it."""

    def __init__(self):
        self.steps = []

    def on_step_start(self, fitter, state, control):
        self.steps.append((state.epoch_index, state.stop_deferred or control.should_training_stop))


def test_trainer_min_steps_and_min_epochs_not_reached(tmp_path, caplog):
    """tests/tests_pytorch/trainer/test_trainer.py::test_trainer_min_steps_and_min_epochs_not_reached:
    EarlyStopping asks to stop at the end of epoch 1 (its loss never improves: Lightning zeroes it,
    here the learning rate is 0); min_epochs=5 holds the stop until 5 epochs of 2 batches are done,
    and says so once. (Lightning's patience=0 stops at the first evaluation without improvement,
    which lightlike's patience=1 does.)"""
    counts = Counts()
    early_stop = ll.EarlyStopping(monitor="val/loss", patience=1)
    min_epochs = 5
    f = fitter(tmp_path, [early_stop, counts], min_epochs=min_epochs, limit_train_batches=2, max_epochs=1000,
               learning_rate=0.0, eval_on_epoch_end=True)
    with caplog.at_level(logging.INFO, logger="lightlike"):
        f.fit(Classifier(), DictDataset(n=64), DictDataset(n=8, seed=1))

    message = f"min_epochs={min_epochs} or min_steps=None has not been reached"
    num_messages = sum(1 for record in caplog.records if message in record.getMessage())
    assert num_messages == 1
    assert len(counts.steps) == min_epochs * 2
    for epoch, should_stop in counts.steps:
        assert should_stop is (epoch >= 2)


class StopAtEveryEpochEnd(ll.Callback):
    """Lightning's test mocks EarlyStopping's criterion to ask for a stop at every check (each
    training epoch's end)."""

    def on_epoch_end(self, fitter, state, control):
        control.should_training_stop = True


@pytest.mark.parametrize(
    ("limit_train_batches", "min_epochs", "min_steps", "stop_step"),
    [
        (3, 0, 10, 10),
        (5, 0, 10, 10),
        (3, 2, 0, 6),
        (5, 2, 0, 10),
        (3, 1, 10, 10),
        (5, 1, 10, 10),
        (3, 3, 10, 10),
        (5, 3, 10, 15),
    ],
)
def test_min_epochs_min_steps_global_step(tmp_path, limit_train_batches, min_epochs, min_steps, stop_step):
    """tests/tests_pytorch/callbacks/test_early_stopping.py::test_min_epochs_min_steps_global_step.
    Lightning's ``current_epoch`` counts an epoch stopped part-way as begun and done; lightlike's
    ``state.epoch`` counts its fraction, so its ceiling is that count."""
    if min_steps:
        assert limit_train_batches < min_steps
    f = fitter(tmp_path, [StopAtEveryEpochEnd()], limit_train_batches=limit_train_batches, min_epochs=min_epochs,
               min_steps=min_steps, max_epochs=1000)
    result = f.fit(Classifier(), DictDataset(n=64))

    expected_epochs = max(math.ceil(min_steps / limit_train_batches), min_epochs)
    assert f.control.should_training_stop
    # epochs continue until min steps are reached
    assert math.ceil(result.state.epoch) == expected_epochs
    # steps continue until min steps are reached AND the epoch is exhausted
    assert result.global_step == stop_step


class Scripted(Classifier):
    """Evaluation metric ``abc`` of the n-th evaluation is ``values[n]`` (Lightning's test logs
    ``losses[current_epoch]`` at each validation epoch's end)."""

    def __init__(self, values):
        super().__init__()
        self.values, self.evals = values, 0

    def metrics(self, outputs, batch):
        return {"abc": torch.tensor(float(self.values[self.evals]))}


class CountEvaluations(ll.Callback):
    def on_evaluate(self, fitter, state, control, metrics):
        fitter.module.evals += 1


@pytest.mark.parametrize(
    ("stopping_threshold", "divergence_threshold", "losses", "expected_epoch"),
    [
        (None, None, [8, 4, 2, 3, 4, 5, 8, 10], 5),
        (2.9, None, [9, 8, 7, 6, 5, 6, 4, 3, 2, 1], 8),
        (None, 15.9, [9, 4, 2, 16, 32, 64], 3),
    ],
)
def test_early_stopping_thresholds(tmp_path, stopping_threshold, divergence_threshold, losses, expected_epoch):
    """tests/tests_pytorch/callbacks/test_early_stopping.py::test_early_stopping_thresholds"""
    early_stopping = ll.EarlyStopping(monitor="val/abc", stopping_threshold=stopping_threshold,
                                      divergence_threshold=divergence_threshold)
    f = fitter(tmp_path, [early_stopping, CountEvaluations()], limit_train_batches=0.2, limit_val_batches=0.2,
               max_epochs=20, eval_on_epoch_end=True)
    result = f.fit(Scripted(losses), DictDataset(n=64), DictDataset(n=64, seed=1))
    # Lightning's current_epoch after the stop is lightlike's epoch_index: the stopping epoch ended
    assert result.state.epoch_index - 1 == expected_epoch, "early_stopping failed"


@pytest.mark.parametrize("stop_value", [torch.tensor(torch.inf), torch.tensor(torch.nan)])
def test_early_stopping_on_non_finite_monitor(tmp_path, stop_value):
    """tests/tests_pytorch/callbacks/test_early_stopping.py::test_early_stopping_on_non_finite_monitor;
    Lightning's ``stopped_epoch`` is here the step EarlyStopping stopped at, the end of epoch 2
    (6 batches an epoch: 0.2 of 32)."""
    losses = [4, 3, stop_value, 2, 1]
    expected_stop_epoch = 2
    early_stopping = ll.EarlyStopping(monitor="val/abc", check_finite=True)
    f = fitter(tmp_path, [early_stopping, CountEvaluations()], limit_train_batches=0.2, limit_val_batches=0.2,
               max_epochs=10, eval_on_epoch_end=True)
    result = f.fit(Scripted(losses), DictDataset(n=64), DictDataset(n=64, seed=1))
    assert result.state.epoch_index - 1 == expected_stop_epoch
    assert early_stopping.stopped_step == (expected_stop_epoch + 1) * 6

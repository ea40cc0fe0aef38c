"""Lightning's Trainer flag tests (lightning tests/tests_pytorch/trainer/flags/ and
trainer/test_trainer.py::test_log_every_n_steps), ported to lightlike's fields: ``eval_every``
(optimizer steps) for ``val_check_interval``/``check_val_every_n_epoch``, ``log_every`` for
``log_every_n_steps``. BoringModel's loaders: 64 batches of one item."""

from __future__ import annotations

import pytest
import torch
from peers_common import BoringModel, RandomDataset, boring_fitter

import lightlike as ll

LAST_STEP = "docs/migrating.md: a fit with evaluation data evaluates its last step"


class Counts(ll.Callback):
    def __init__(self):
        self.train_epochs, self.evals, self.eval_steps = 0, 0, []

    def on_epoch_start(self, fitter, state, control):
        self.train_epochs += 1

    def on_evaluate(self, fitter, state, control, metrics):
        self.evals += 1
        self.eval_steps.append(state.global_step)


def _fit(tmp_path, train=64, val=64, **fields):
    counts = Counts()
    fitter = boring_fitter(tmp_path, callbacks=[counts], eval_batch_size=64, **fields)
    result = fitter.fit(BoringModel(), RandomDataset(32, train), RandomDataset(32, val, seed=1) if val else None)
    return counts, fitter, result


@pytest.mark.parametrize("max_epochs", [1, 2, 3])
@pytest.mark.parametrize("denominator", [1, pytest.param(3, marks=pytest.mark.xfail(strict=True, reason=LAST_STEP)), 4])
def test_val_check_interval(tmp_path, max_epochs, denominator):
    """lightning tests/tests_pytorch/trainer/flags/test_val_check_interval.py::test_val_check_interval:
    val_check_interval=1/denominator of 64 batches is eval_every=int(64/denominator); max_epochs
    training epochs and max_epochs * denominator evaluations. With 3, 64 is no multiple of 21 and
    lightlike's evaluation of the last step is one more."""
    counts, _, _ = _fit(tmp_path, max_epochs=max_epochs, eval_every=int(64 / denominator))
    assert counts.train_epochs == max_epochs
    assert counts.evals == max_epochs * denominator


@pytest.mark.parametrize("use_infinite_dataset", [True, False])
def test_validation_check_interval_exceed_data_length_correct(tmp_path, use_infinite_dataset):
    """lightning tests/tests_pytorch/trainer/flags/test_val_check_interval.py::test_validation_check_interval_exceed_data_length_correct
    (accumulate_grad_batches=1; lightlike's eval_every counts optimizer steps, so accumulation 2
    cannot evaluate mid-window as Lightning does): 4 samples, 3 epochs, val_check_interval=3
    with check_val_every_n_epoch=None evaluates across epoch ends, at 3, 6, 9, 12."""
    max_steps = 4 * 3
    if use_infinite_dataset:
        class Endless(torch.utils.data.IterableDataset):
            def __iter__(self):
                yield from RandomDataset(32, max_steps + 100)
        train = Endless()
    else:
        train = RandomDataset(32, 4)
    counts = Counts()
    fitter = boring_fitter(tmp_path, callbacks=[counts], max_steps=max_steps, eval_every=3)
    result = fitter.fit(BoringModel(), train, RandomDataset(32, 1, seed=1))
    assert result.global_step == max_steps
    if not use_infinite_dataset:
        assert fitter.state.epoch_index == 3  # Lightning's current_epoch == max_epochs
    assert sorted(counts.eval_steps) == [3, 6, 9, 12]


def test_validation_check_interval_exceed_data_length_wrong(tmp_path, caplog):
    """lightning tests/tests_pytorch/trainer/flags/test_val_check_interval.py::test_validation_check_interval_exceed_data_length_wrong:
    an interval of 100 over a run of 10 batches: Lightning raises; lightlike warns at set-up, naming
    both numbers, and evaluates the last step only."""
    counts, _, _ = _fit(tmp_path, train=10, val=1, max_epochs=1, eval_every=100)
    assert "eval_every=100 is larger than this run's 10 optimizer steps" in caplog.text
    assert counts.eval_steps == [10]


@pytest.mark.parametrize(("max_epochs", "expected_val_loop_calls"), [
    pytest.param(1, 0, marks=pytest.mark.xfail(strict=True, reason=LAST_STEP)),
    (4, 2),
    pytest.param(5, 2, marks=pytest.mark.xfail(strict=True, reason=LAST_STEP)),
])
def test_check_val_every_n_epoch(tmp_path, max_epochs, expected_val_loop_calls):
    """lightning tests/tests_pytorch/trainer/flags/test_check_val_every_n_epoch.py::test_check_val_every_n_epoch:
    check_val_every_n_epoch=2 (eval_every=2 epochs of 64 steps), limit_val_batches=2."""
    counts, _, _ = _fit(tmp_path, val=2, max_epochs=max_epochs, eval_every=2 * 64)
    assert counts.evals == expected_val_loop_calls


def test_check_val_every_n_epoch_with_max_steps(tmp_path):
    """lightning tests/tests_pytorch/trainer/flags/test_check_val_every_n_epoch.py::test_check_val_every_n_epoch_with_max_steps:
    2 samples, max_steps 8 with check_val_every_n_epoch=3: 4 epochs, 8 steps."""
    counts, fitter, result = _fit(tmp_path, train=2, val=1, max_steps=2 * 4, eval_every=2 * 3)
    assert fitter.state.epoch == 4
    assert result.global_step == 8
    assert counts.eval_steps == [6, 8]


@pytest.mark.parametrize(("train_batches", "max_steps", "log_interval"), [(10, 10, 1), (3, 10, 1), (3, 10, 5)])
def test_log_every_n_steps(tmp_path, train_batches, max_steps, log_interval):
    """lightning tests/tests_pytorch/trainer/test_trainer.py::test_log_every_n_steps: rows every
    log_interval steps across epoch ends. Lightning's logger gets the step 0-based
    (``range(log_interval - 1, max_steps, log_interval)``); a lightlike row's step counts the
    optimizer steps taken, one more."""
    fitter = boring_fitter(tmp_path, max_steps=max_steps, log_every=log_interval, loggers=["jsonl"])
    fitter.fit(BoringModel(), RandomDataset(32, train_batches))
    expected = [s + 1 for s in range(log_interval - 1, max_steps, log_interval)]
    assert [row["step"] for row in fitter.state.log_history if "train/loss" in row] == expected
    import json
    written = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in written if "train/loss" in row] == expected

"""Fractional ``max_epochs`` (HF's ``num_train_epochs=2.5``): the run takes ceil(epochs * steps
per epoch) optimizer steps, and the schedule's total is that count (issue 35)."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.data.loading import epoch_steps


def _fitter(tmp_path, callbacks=(), **kw):
    cfg = dict(batch_size=2, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False, save_strategy="no",
               progress_bar=False, log_level="error")
    cfg.update(kw)
    return ll.Fitter(callbacks=list(callbacks), **cfg)


def test_two_and_a_half_epochs_take_the_hf_trainers_steps_with_the_schedule_over_them(tmp_path):
    """10 items in batches of 2: 5 steps per epoch; 2.5 epochs = ceil(12.5) = 13 steps, as the
    HF Trainer counts ``num_train_epochs=2.5``. Every row's train/epoch is step / 5, and the
    linear schedule over 13 steps gives lr = 0.1 * (1 - step / 13) after each step, 0 at the last."""
    rows = []

    class Rows(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            rows.append((state.global_step, metrics["train/epoch"], metrics["train/lr"]))

    result = _fitter(tmp_path, [Rows()], max_epochs=2.5, log_every=1, learning_rate=0.1,
                     lr_scheduler="linear").fit(Classifier(), DictDataset(n=10))
    assert result.global_step == 13 and result.state.max_steps == 13
    assert [r[0] for r in rows] == list(range(1, 14))
    assert [r[1] for r in rows] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6]
    assert [r[2] for r in rows] == pytest.approx([0.1 * (1 - k / 13) for k in range(1, 14)], abs=1e-12)
    assert rows[-1][2] == 0.0  # the schedule ends at the run's last step


def test_epoch_steps_reads_the_decimal_written():
    assert epoch_steps(2.5, 5) == 13 and epoch_steps(2.5, 4) == 10 and epoch_steps(3, 7) == 21
    assert epoch_steps(2.2, 25) == 55  # 2.2 * 25 is 55.00000000000001 in binary floats
    assert epoch_steps(0.5, 1) == 1 and epoch_steps(0.01, 5) == 1  # a fraction of a step is a step, as in HF
    # resumed in epoch 1 of 2.3: the epochs after it, 0.3 of 10 steps, are 3 (in floats 2.3 - 2 is 0.2999...8)
    assert epoch_steps(2.3, 10, 2) == 3 and epoch_steps(2.5, 3, 3) == -1  # half of epoch 2, less the whole of it


def test_fractional_epochs_refused_without_a_data_length(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(DictDataset(n=8)[i] for i in range(8))

    with pytest.raises(ll.ConfigError, match=r"no length \(IterableDataset\): set max_steps; max_epochs=2.5 is a "
                                             r"fraction of an epoch's optimizer steps"):
        _fitter(tmp_path, max_epochs=2.5).fit(Classifier(), Stream())
    with pytest.raises(ll.ConfigError, match=r"max_epochs takes a number \(int or float\) or None; write "
                                             r"max_epochs=2.5, not the string '2.5'"):
        ll.FitConfig(max_epochs="2.5")
    for bad in (0, -1.5, float("nan")):
        with pytest.raises(ll.ConfigError, match=r"max_epochs must be a number of epochs > 0 \(2 or 2.5\), got"):
            ll.FitConfig(max_epochs=bad)
    with pytest.raises(ll.ConfigError, match=r"max_epochs=inf never ends: set max_steps"):
        ll.FitConfig(max_epochs=float("inf"))


def test_a_resume_with_other_steps_per_epoch_counts_the_fraction_from_where_it_stands(tmp_path):
    """Stopped at step 7 (epoch 1, 2 of its 5 batches taken), resumed with grad_accum_steps=2:
    3 steps per epoch now. What is left: epoch 1's 3 batches in 2 steps (8, 9), then half of
    epoch 2, ceil(0.5 * 3) = 2 steps: the run ends at step 11 (its schedule's total too)."""
    class StopAt7(ll.Callback):
        def on_step_end(self, fitter, state, control):
            control.should_training_stop = state.global_step == 7

    cfg = dict(max_epochs=2.5, save_strategy="steps", save_every=7, learning_rate=0.1, lr_scheduler="linear")
    first = _fitter(tmp_path, [StopAt7()], **cfg).fit(Classifier(), DictDataset(n=10))
    assert first.global_step == 7 and (tmp_path / "run" / "checkpoint-7").is_dir()
    rows = []

    class Rows(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            rows.append((state.global_step, metrics["train/epoch"], metrics["train/lr"]))

    second = _fitter(tmp_path, [Rows()], grad_accum_steps=2, log_every=1, **cfg).fit(
        Classifier(), DictDataset(n=10), resume=True)
    assert second.global_step == 11 and second.state.max_steps == 11
    assert [(step, epoch) for step, epoch, _ in rows] == [(8, 1.8), (9, 2.0), (10, 2.4), (11, 2.8)]
    assert rows[-1][2] == 0.0

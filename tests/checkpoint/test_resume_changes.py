"""Resuming with changed settings: what the resumed run plans, warns about and applies.

A sized IterableDataset's schedule after a changed step budget, a mid-epoch resume on more
processes, a logger switched off for one resumed run and on again, num_workers changed at an
epoch's end of an IterableDataset, and a changed ``fused``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset
from launching import launch
from scripts.resume_world_size_target import Indexed
from torch.utils.data import IterableDataset

import lightlike as ll

SCRIPT = Path(__file__).parents[1] / "scripts" / "resume_world_size_target.py"


class Stream(IterableDataset):
    """``n`` items of a DictDataset, in the same order every time it is read, with a ``__len__``."""

    def __init__(self, n: int):
        self.d = DictDataset(n=n)

    def __len__(self):
        return len(self.d)

    def __iter__(self):
        return (self.d[i] for i in range(len(self.d)))


class StopAt(ll.Callback):
    """Interrupts the run as step ``step`` ends (as a kill there: no checkpoint of that step)."""

    def __init__(self, step: int, at_start: bool = False):
        self.step, self.at_start = step, at_start

    def on_step_start(self, fitter, state, control):
        if self.at_start and state.global_step == self.step:
            raise KeyboardInterrupt

    def on_step_end(self, fitter, state, control):
        if not self.at_start and state.global_step == self.step:
            raise KeyboardInterrupt


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- a sized IterableDataset's schedule ---------------------------------------------------------
@pytest.mark.parametrize("changed, steps", [
    # 12 batches an epoch; checkpoint-2 is 4 batches into epoch 0 (8 left)
    ({"max_epochs": 3}, 2 + 4 + 6 + 6),    # 8 left / 2 = 4 steps, then 2 epochs of 6
    ({"grad_accum_steps": 4}, 2 + 2 + 3),  # 8 left / 4 = 2 steps, then 1 epoch of 3
])
def test_sized_iterable_resumed_mid_epoch_with_a_changed_step_budget_ends_its_schedule_at_its_last_step(
        tmp_path, changed, steps):
    """An IterableDataset with a __len__, resumed mid-epoch with max_epochs or grad_accum_steps
    changed: the plan counted a whole epoch for the resumed one (20 steps planned, 18 taken; the
    linear schedule never reached 0). It counts the batches left after those read again."""
    lrs = {}

    class Lr(ll.Callback):
        def on_step_end(self, fitter, state, control):
            lrs[state.global_step] = fitter.optimizer.param_groups[0]["lr"]

    cfg = dict(max_epochs=2, batch_size=2, grad_accum_steps=2, save_every=2, output_dir=str(tmp_path), loggers=[],
               log_level="error")
    with contextlib.suppress(KeyboardInterrupt):
        ll.Fitter(**cfg, callbacks=[StopAt(3)]).fit(Classifier(), Stream(24))
    result = ll.Fitter(**{**cfg, **changed}, callbacks=[Lr()]).fit(Classifier(), Stream(24), resume=True)
    epochs = changed.get("max_epochs", 2)
    assert result.state.samples_seen == 24 * epochs and result.state.epoch == float(epochs)
    assert result.global_step == result.state.max_steps == steps
    assert lrs[steps] == 0.0


# -- a mid-epoch resume on more processes ---------------------------------------------------------
def test_resume_mid_epoch_on_more_processes_warns_of_the_samples_its_uneven_rest_leaves_out(tmp_path):
    """26 items, 9 taken on 1 process, resumed on 2: the 17 left do not split evenly and one is
    left out so that both processes take the same samples and steps. Nothing said so (a fresh
    start warns of an uneven dataset), though the docs promised every sample of the epoch once."""
    served = []

    class Recording(Classifier):
        def forward(self, batch):
            served.append(batch["i"].tolist())
            return super().forward(batch)

    with contextlib.suppress(KeyboardInterrupt):  # checkpoint-3: 9 of the 26 samples of epoch 0
        ll.Fitter(output_dir=str(tmp_path), loggers=[], log_level="error", save_every=1, max_epochs=2, batch_size=3,
                  callbacks=[StopAt(4)]).fit(Recording(), Indexed(n=26))
    before = [i for batch in served[:3] for i in batch]
    p = launch(2, tmp_path, script=SCRIPT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    after = [json.loads((tmp_path / f"served-rank{r}.json").read_text()) for r in (0, 1)]
    epoch0 = before + [i for rank in after for e, b in rank if e == 0 for i in b]
    epoch1 = [i for rank in after for e, b in rank if e == 1 for i in b]
    assert sorted(epoch1) == list(range(26))  # the next epoch is whole
    assert len(epoch0) == len(set(epoch0)) == 25  # one of the 17 left out, none repeated
    assert "resuming epoch 0 at sample 9 of 26 on 2 processes: the 17 sample(s) left of it do not split evenly, " \
           "so 1 of them are left out of this epoch" in p.stderr


# -- a logger switched off for one resumed run ----------------------------------------------------
@pytest.mark.parametrize("toggled, kept", [("tensorboard", "csv"), ("csv", "tensorboard")])
def test_a_logger_left_out_of_one_resumed_run_drops_the_abandoned_steps_when_enabled_again(tmp_path, toggled, kept):
    """Run 1 logs steps 1-6 and is cut (checkpoint-4); run 2 resumes without one logger (and another
    learning rate) to step 8; run 3 resumes with it again to step 10. That logger kept run 1's
    steps 5-6 (the abandoned values): its purge was at run 3's step only. It now shows steps 1-4 and
    9-10, every one the final run's, and the logger on throughout steps 1-10."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def fit(loggers, stop=None, **changed):
        cfg = dict(max_steps=10, batch_size=4, save_every=4, log_every=1, output_dir=str(tmp_path), loggers=loggers,
                   log_level="error", learning_rate=1e-2, callbacks=[StopAt(6, at_start=True)] if stop else [])
        torch.manual_seed(0)
        with contextlib.suppress(KeyboardInterrupt):
            ll.Fitter(**{**cfg, **changed}).fit(Classifier(), DictDataset(n=40), resume=None if stop else True)

    fit([toggled, kept], stop=True)
    fit([kept], learning_rate=2e-2, max_steps=8)
    fit([toggled, kept], learning_rate=2e-2)

    rows = list(csv.reader(open(tmp_path / "logs" / "metrics.csv")))[1:]
    csv_lr = {int(s): float(v) for s, name, v in rows if name == "train/lr"}
    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    tb_lr = {e.step: e.value for e in events.Scalars("train/lr")}
    on, off = (csv_lr, tb_lr) if kept == "csv" else (tb_lr, csv_lr)
    assert sorted(on) == list(range(1, 11))
    assert sorted(off) == [1, 2, 3, 4, 9, 10]
    assert all(off[s] == pytest.approx(on[s]) for s in off)


# -- num_workers changed at an epoch's end of an IterableDataset --------------------------------------
def test_num_workers_changed_at_an_epoch_end_of_an_iterable_is_named_in_the_changed_settings_warning(
        tmp_path, caplog):
    """An IterableDataset is dealt over the workers: resumed at an epoch's end with num_workers 0 ->
    2, its next epochs are read in another order, yet no warning said the run was no longer a pure
    continuation (the data-order check ran mid-epoch only; a batch_size change was warned)."""
    def fit(workers, stop=False):
        torch.manual_seed(0)
        with contextlib.suppress(KeyboardInterrupt):  # checkpoint-4: the end of epoch 0
            ll.Fitter(max_epochs=2, batch_size=4, save_every=4, output_dir=str(tmp_path), loggers=[],
                      num_workers=workers, callbacks=[StopAt(5)] if stop else []).fit(
                Classifier(), Stream(16), resume=None if stop else True)

    fit(0, stop=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fit(2)
    assert any("changed settings" in m and "data order's num_workers: 0 -> 2" in m for m in warnings_of(caplog))


# -- fused changed ------------------------------------------------------------------------------------
@pytest.mark.parametrize("before, after", [(None, False), (False, True)])
def test_a_changed_fused_takes_effect_on_resume_with_a_warning(tmp_path, caplog, before, after):
    """fused changed between a run and its resume: the restored optimizer state brought back the
    checkpoint's kernel (its param_groups' fused), silently. The new setting now takes effect (the
    optimizer's groups, and every step counter where that kernel keeps it), named in the warning."""
    def fit(fused, resume=None, callbacks=()):
        torch.manual_seed(0)
        fitter = ll.Fitter(max_steps=8, batch_size=4, save_every=4, output_dir=str(tmp_path), loggers=[],
                           fused=fused, callbacks=list(callbacks))
        with contextlib.suppress(KeyboardInterrupt):
            fitter.fit(Classifier(), DictDataset(n=40), resume=resume)
        return fitter

    fit(before, callbacks=[StopAt(5)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fitter = fit(after, resume=True)
    assert fitter.state.global_step == 8
    assert any(f"fused: {before!r} -> {after!r}" in m for m in warnings_of(caplog))
    optimizer = fitter.optimizer
    assert all(bool(g["fused"]) == after for g in optimizer.param_groups)
    assert all(s["step"].dtype == torch.float32 and s["step"].device.type == "cpu" for s in optimizer.state.values())

"""A mid-epoch resume on training data of another length: refused by default (both lengths named),
or, with ``resume_data_changed='restart_epoch'``, the epoch starts again over the new data in its
documented order (``randperm(n, seed + epoch)``); the same length continues exactly.

Every run: batches of 8, seed 5, shuffled, a checkpoint every 3 steps; the first run is stopped
after step 5 (``StopAt``: as a kill there), so ``checkpoint-3`` is the newest, 24 samples into
epoch 0 of 64 items. The ids each training batch holds are recorded (the items carry their index).
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from helpers import StopAt
from scripts.resume_world_size_target import Indexed, Recording

import lightlike as ll
from lightlike.checkpoint import verify_checkpoint
from lightlike.checkpoint.manifest import CHECKSUM, MANIFEST, file_hash
from lightlike.errors import CheckpointError

SEED, BATCH = 5, 8


def fit(out, n, *, stop=None, resume=None, **options):
    """Train on ``n`` items up to step 12 (or ``stop``); the training batches' ids, in order."""
    module = Recording()
    settings = dict(max_steps=12, batch_size=BATCH, seed=SEED, save_every=3, output_dir=str(out), loggers=[],
                    model_summary=False, log_level="warning")
    fitter = ll.Fitter(**{**settings, **options}, callbacks=[StopAt(stop)] if stop else [])
    with contextlib.suppress(KeyboardInterrupt):
        fitter.fit(module, Indexed(n=n), resume=resume)
    return [ids for _, ids in module.served]


def order(n, epoch):
    """The documented order of an epoch: torch.randperm(n) from a generator seeded seed + epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def batches(ids):
    return [ids[i:i + BATCH] for i in range(0, len(ids), BATCH)]


def interrupted(tmp_path):
    out = tmp_path / "run"
    first = fit(out, 64, stop=5)
    assert first == batches(order(64, 0))[:5]
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["data_length_per_rank"] == [64]
    return out


def test_the_same_length_continues_as_the_uninterrupted_run(tmp_path):
    out = interrupted(tmp_path)
    resumed = fit(out, 64, resume=True)
    expected = batches(order(64, 0))[3:] + batches(order(64, 1))[:4]  # steps 4-12
    assert resumed == expected
    assert fit(tmp_path / "whole", 64)[3:] == expected


def test_another_length_mid_epoch_is_refused_naming_both_lengths_and_the_option(tmp_path):
    out = interrupted(tmp_path)
    with pytest.raises(CheckpointError) as e:
        fit(out, 48, resume=True)
    message = str(e.value)
    assert "checkpoint-3 was taken 24 samples into epoch 0 of training data of 64 items, and this run's has 48" \
        in message
    assert "resume_data_changed='restart_epoch'" in message


def test_restart_epoch_starts_the_epoch_again_over_the_new_data(tmp_path, caplog):
    """Steps 4-9: epoch 0 from its start over the 48 items (6 batches); steps 10-12: epoch 1's."""
    out = interrupted(tmp_path)
    resumed = fit(out, 48, resume=True, resume_data_changed="restart_epoch")
    assert resumed == batches(order(48, 0)) + batches(order(48, 1))[:3]
    assert any("epoch 0 starts again from its start" in r.getMessage() and "of 64 items" in r.getMessage()
               for r in caplog.records)


def test_restart_epoch_counts_the_restarted_epoch_in_a_max_epochs_budget(tmp_path):
    """max_epochs=2 on 60 items instead of 64: 8 steps per epoch either way (the last batch of 4),
    so the saved budget (16 steps) still matches; the restarted epoch 0 takes 8 steps again and
    epoch 1 its 8: 3 + 16 steps."""
    out = tmp_path / "run"
    module = Recording()
    options = dict(max_epochs=2, batch_size=BATCH, seed=SEED, save_every=3, output_dir=str(out), loggers=[],
                   model_summary=False, log_level="warning")
    with contextlib.suppress(KeyboardInterrupt):
        ll.Fitter(**options, callbacks=[StopAt(5)]).fit(module, Indexed(n=64))
    module = Recording()
    result = ll.Fitter(**options, resume_data_changed="restart_epoch").fit(module, Indexed(n=60), resume=True)
    assert [ids for _, ids in module.served] == batches(order(60, 0)) + batches(order(60, 1))
    assert result.global_step == 3 + 16


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "older-checkpoint"])
def test_data_shrunk_below_the_position_is_refused_as_a_changed_length(tmp_path, recorded):
    """16 items, 24 samples into the epoch: the same error as any other length, not the sampler's
    bare ValueError; a checkpoint of an earlier lightlike (no recorded length) too."""
    out = interrupted(tmp_path)
    ckpt = out / "checkpoint-3"
    if not recorded:  # as an earlier lightlike wrote it: no data length, its manifest matching
        saved = json.loads((ckpt / "trainer_state.json").read_text())
        del saved["data_length_per_rank"]
        (ckpt / "trainer_state.json").write_text(json.dumps(saved))
        manifest = json.loads((ckpt / MANIFEST).read_text())
        manifest["files"]["trainer_state.json"] = {"size": (ckpt / "trainer_state.json").stat().st_size,
                                                   CHECKSUM: file_hash(ckpt / "trainer_state.json")}
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
        verify_checkpoint(ckpt)
    for options in ({}, {"max_steps": None, "max_epochs": 2}):  # (the epoch budget reads the position first)
        with pytest.raises(CheckpointError) as e:
            fit(out, 16, resume=str(ckpt), **options)
        was = "of 64 items" if recorded else "whose length it does not record (written by an earlier lightlike)"
        assert f"checkpoint-3 was taken 24 samples into epoch 0 of training data {was}, and this run's has 16" \
            in str(e.value)
        assert "resume_data_changed='restart_epoch'" in str(e.value)
    if not recorded:  # within the data's length, an older checkpoint resumes as before (no check)
        assert fit(out, 48, resume=str(ckpt)) == batches(order(48, 0))[3:] + batches(order(48, 1))[:6]

"""A resume with a changed batch_size, grad_accum_steps or precision (or a DataLoader of the user's
with another batch_size) says so by name in the changed-settings warning, mid-epoch and at an
epoch's end; the resumed run then trains the samples left of the epoch, each once."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import Classifier, DictDataset
from torch.utils.data import DataLoader, Dataset

import lightlike as ll


class Indexed(Dataset):
    def __init__(self, n=24):
        self.d = DictDataset(n=n)

    def __len__(self):
        return len(self.d)

    def __getitem__(self, i):
        return {**self.d[i], "i": torch.tensor(i)}


class Seen(Classifier):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        if self.training:
            self.seen += batch["i"].tolist()
        return super().forward(batch)


class StopAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            raise KeyboardInterrupt


def fit(out, data, *, stop=None, resume=False, **kw):
    module = Seen()
    cfg = {**dict(max_epochs=1, batch_size=4, save_every=2, loggers=[], model_summary=False, progress_bar=False,
                  output_dir=str(out), seed=1), **kw}
    try:
        ll.Fitter(callbacks=[StopAt(stop)] if stop else [], **cfg).fit(module, data, resume=resume)
    except KeyboardInterrupt:
        pass
    return module.seen


def changed_warning(caplog):
    found = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and r.getMessage().startswith("resuming with changed settings")]
    assert len(found) == 1, caplog.text
    return found[0]


@pytest.mark.parametrize(("changed", "named"), [
    ({"batch_size": 2}, "batch_size: 4 -> 2"),
    ({"grad_accum_steps": 2}, "grad_accum_steps: 1 -> 2"),
    ({"precision": "bf16-mixed"}, "precision: 'auto' -> 'bf16-mixed'"),
])
def test_a_changed_setting_is_named_at_a_mid_epoch_resume(tmp_path, caplog, changed, named):
    first = fit(tmp_path, Indexed(), stop=3)  # checkpoint-2: 8 of the epoch's 24 samples
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        rest = fit(tmp_path, Indexed(), resume=True, **changed)
    assert named in changed_warning(caplog)
    assert sorted(first[:8] + rest) == list(range(24))  # the rest of the epoch, each sample once


@pytest.mark.parametrize("stop", [3, 7])  # mid-epoch (checkpoint-2), at the epoch's end (checkpoint-6)
def test_a_dataloader_with_another_batch_size_is_named(tmp_path, caplog, stop):
    """The DataLoader's batch_size is the one trained with (the Fitter's is left as it was): its
    change is named too; lightlike's sampler seeks by samples, so mid-epoch it continues the epoch."""
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
    first = fit(tmp_path, loader, stop=stop, max_epochs=2)
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        rest = fit(tmp_path, DataLoader(Indexed(), batch_size=6, shuffle=True), resume=True, max_epochs=2)
    assert "data order's batch_size: 4 -> 6" in changed_warning(caplog)
    done = first[:8] if stop == 3 else first[:24]  # (the steps after the checkpoint are trained again)
    assert sorted(done + rest[:24 - len(done)]) == list(range(24)) and sorted(rest[24 - len(done):]) == list(range(24))

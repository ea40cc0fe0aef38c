"""Lightning's ModelCheckpoint tests (lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py),
ported: ``every_n_train_steps`` is ``save_every``, ``monitor``/``mode`` are ``metric_for_best``/
``greater_is_better``, ``save_top_k`` is ``save_total_limit`` (the best is always kept)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peers_common import BoringModel, RandomDataset, boring_fitter

import lightlike as ll


def _steps(path):
    return sorted(int(p.name.split("-")[1]) for p in path.glob("checkpoint-*"))


class Saves(ll.Callback):
    def __init__(self):
        self.paths = []

    def on_save(self, fitter, state, control, path):
        self.paths.append(path)


class EpochValues(BoringModel):
    """Evaluates to ``values[epoch]`` under the name ``abc`` (Lightning's ``self.log("abc", ...)``)."""

    def __init__(self, values):
        super().__init__()
        self.values = values
        self.epoch = 0

    def metrics(self, outputs, batch):
        return {"abc": torch.tensor(float(self.values[self.epoch]))}


class TellEpoch(ll.Callback):
    def on_epoch_start(self, fitter, state, control):
        fitter.module.epoch = state.epoch_index


def test_ckpt_every_n_train_steps(tmp_path):
    """lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py::test_ckpt_every_n_train_steps:
    every 16 steps over 2 epochs of 64: step 16, 32, ..., 128."""
    boring_fitter(tmp_path, max_epochs=2, save_strategy="steps", save_every=16).fit(BoringModel(), RandomDataset())
    assert _steps(tmp_path) == list(range(16, 2 * 64 + 1, 16))


FINAL_SAVE = "docs/migrating.md: A fit that ends saves a checkpoint of its last step"


@pytest.mark.parametrize("every_n_epochs", [
    1,
    pytest.param(2, marks=pytest.mark.xfail(strict=True, reason=FINAL_SAVE)),
    pytest.param(3, marks=pytest.mark.xfail(strict=True, reason=FINAL_SAVE)),
])
def test_model_checkpoint_every_n_epochs(tmp_path, every_n_epochs):
    """lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_every_n_epochs:
    5 epochs of one batch, a checkpoint at each epoch e with (e + 1) % every_n_epochs == 0 (here
    save_every epochs' steps). lightlike saves the last step (5) too, as Lightning's save_last=True."""
    boring_fitter(tmp_path, max_epochs=5, save_strategy="steps", save_every=every_n_epochs).fit(
        BoringModel(), RandomDataset(32, 1))
    expected = [e + 1 for e in range(5) if not (e + 1) % every_n_epochs]
    assert _steps(tmp_path) == expected


def test_model_checkpoint_topk_zero(tmp_path):
    """lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_topk_zero:
    no monitor, save_top_k=0, save_last=True: only the last checkpoint (the default here), no best."""
    fitter = boring_fitter(tmp_path, max_epochs=2, save_strategy="steps")
    result = fitter.fit(BoringModel(), RandomDataset())
    assert _steps(tmp_path) == [128]
    assert result.best_checkpoint is None and fitter.state.best_metric is None
    assert result.last_checkpoint == str(tmp_path / "checkpoint-128")


def test_model_checkpoint_topk_all(tmp_path):
    """lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_topk_all:
    monitor="epoch", mode="max", save_top_k=-1 over 3 epochs: the best is the last epoch's, with
    score 2, and every epoch's checkpoint is kept."""
    fitter = boring_fitter(tmp_path, callbacks=[TellEpoch()], max_epochs=3, eval_on_epoch_end=True,
                           save_strategy="epoch", metric_for_best="abc", greater_is_better=True)
    result = fitter.fit(EpochValues([0, 1, 2]), RandomDataset(32, 4), RandomDataset(32, 2, seed=1))
    assert result.best_checkpoint == str(tmp_path / "checkpoint-12")
    assert fitter.state.best_metric == 3 - 1
    assert _steps(tmp_path) == [4, 8, 12]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_checkpointing_with_nan_as_first(tmp_path, mode):
    """lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py::test_checkpointing_with_nan_as_first:
    the monitored value is NaN at the first epoch, then [5, 7, 8] (max) or [8, 7, 5] (min): a save
    every epoch, and the best is 8 or 5 (NaN never best)."""
    values = [math.nan] + ([5, 7, 8] if mode == "max" else [8, 7, 5])
    saves = Saves()
    fitter = boring_fitter(tmp_path, callbacks=[TellEpoch(), saves], max_epochs=4, eval_on_epoch_end=True,
                           save_strategy="epoch", save_total_limit=1, metric_for_best="abc",
                           greater_is_better=mode == "max")
    fitter.fit(EpochValues(values), RandomDataset(32, 2), RandomDataset(32, 2, seed=1))
    assert len(saves.paths) == len(values)
    assert fitter.state.best_metric == (8 if mode == "max" else 5)
    assert _steps(tmp_path) == [8]


def test_model_checkpoint_score_and_ckpt(tmp_path):
    """lightning tests/tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt
    (monitor="val_log", save_top_k=-1, 3 epochs of 5 batches): a checkpoint per epoch, its score
    the epoch's mean of the logged values, its global step 5 * (epoch + 1)."""
    logged = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))

    class Logs(BoringModel):
        epoch, batch = 0, 0

        def metrics(self, outputs, batch):
            value = logged[self.epoch, self.batch % 7]
            self.batch += 1
            return {"val_log": value}

    class Tell(ll.Callback):
        def on_epoch_start(self, fitter, state, control):
            fitter.module.epoch, fitter.module.batch = state.epoch_index, 0

    fitter = boring_fitter(tmp_path, callbacks=[Tell()], max_epochs=3, eval_on_epoch_end=True, save_strategy="epoch",
                           metric_for_best="val_log", greater_is_better=False)
    fitter.fit(Logs(), RandomDataset(32, 5), RandomDataset(32, 7, seed=1))
    scores = [row["val/val_log"] for row in fitter.state.log_history if "val/val_log" in row]
    assert len(scores) == 3
    for epoch, score in enumerate(scores):
        assert math.isclose(score, logged[epoch].mean().item(), abs_tol=1e-5)
        saved = json.loads((tmp_path / f"checkpoint-{5 * (epoch + 1)}" / "trainer_state.json").read_text())["state"]
        assert saved["global_step"] == 5 * (epoch + 1)
        assert saved["epoch"] == epoch + 1  # epochs completed (Lightning's chk["epoch"] is the 0-based one running)
        assert [row["val/val_log"] for row in saved["log_history"] if "val/val_log" in row][-1] == score

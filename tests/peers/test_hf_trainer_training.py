"""The HF Trainer's own training tests (transformers tests/trainer/test_trainer.py, the
``RegressionModel``/``RegressionDataset`` ones), ported to lightlike: each keeps the original's
assertion and numbers and names its origin. ``get_regression_trainer`` is ``regression_fitter``."""

from __future__ import annotations

import math

import pytest
import torch
from peers_common import QUIET, RegressionDataset, RegressionModel, regression_fitter

import lightlike as ll

ORIGIN = "transformers tests/trainer/test_trainer.py"


def _train(tmp_path, model=None, train_len=64, val=None, callbacks=None, **kwargs):
    model = model if model is not None else RegressionModel()
    fitter = regression_fitter(tmp_path, callbacks=callbacks, **kwargs)
    result = fitter.fit(model, RegressionDataset(length=train_len), val)
    return fitter, model, result


@pytest.fixture(scope="module")
def default_trained(tmp_path_factory):
    """``TrainerIntegrationPrerunTest.setUp``: the model trained with lr 0.1, seeds 42 and 314."""
    _, m, _ = _train(tmp_path_factory.mktemp("default"), learning_rate=0.1)
    _, alt, _ = _train(tmp_path_factory.mktemp("alternate"), learning_rate=0.1, seed=314)
    return (m.a.detach().clone(), m.b.detach().clone()), (alt.a.detach().clone(), alt.b.detach().clone())


def test_reproducible_training(tmp_path, default_trained):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationPrerunTest::test_reproducible_training"""
    (a, b), (a2, b2) = default_trained
    _, m, _ = _train(tmp_path / "1", learning_rate=0.1)
    assert torch.allclose(m.a, a) and torch.allclose(m.b, b)
    _, m, _ = _train(tmp_path / "2", learning_rate=0.1, seed=314)
    assert torch.allclose(m.a, a2) and torch.allclose(m.b, b2)
    assert not torch.allclose(a, a2)  # the seed is the data order's


def test_gradient_accumulation(tmp_path, default_trained):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationPrerunTest::test_gradient_accumulation:
    half the batch size with two accumulation steps trains the same model."""
    (a, b), _ = default_trained
    _, m, _ = _train(tmp_path, grad_accum_steps=2, batch_size=4, learning_rate=0.1)
    assert torch.allclose(m.a, a) and torch.allclose(m.b, b)


def test_gradient_accumulation_matches_a_hand_loop(tmp_path):
    """The same, against a hand-written AdamW loop over lightlike's data order (batch 8 and 4 x 2)."""
    fitter, m, _ = _train(tmp_path, grad_accum_steps=2, batch_size=4, learning_rate=0.1, max_grad_norm=None,
                          lr_scheduler="constant")
    data = RegressionDataset()
    ref = RegressionModel()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.ys[0])
    for epoch in range(3):
        order = torch.randperm(64, generator=torch.Generator().manual_seed(42 + epoch))
        for i in range(0, 64, 8):
            idx = order[i:i + 8]
            loss = torch.nn.functional.mse_loss(x[idx] * ref.a + ref.b, y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(m.a, ref.a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.b, ref.b, rtol=1e-5, atol=1e-6)


def test_training_arguments_are_left_untouched(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_training_arguments_are_left_untouched"""
    fitter = regression_fitter(tmp_path)
    before = fitter.config.to_dict()
    fitter.fit(RegressionModel(), RegressionDataset())
    after = fitter.config.to_dict()
    assert before == after


@pytest.mark.parametrize(("fields", "steps"), [
    ({}, 3 * 64 // 8),
    ({"max_epochs": 1.5}, int(1.5 * 64 / 8)),
    ({"max_steps": 10}, 10),
])
def test_number_of_steps_in_training(tmp_path, fields, steps):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_number_of_steps_in_training:
    n_epochs * len(train_dl) steps, a float num_train_epochs, and max_steps winning over epochs."""
    _, _, result = _train(tmp_path, learning_rate=0.1, **fields)
    assert result.global_step == steps


def test_max_steps_beyond_the_epochs(tmp_path):
    """transformers TrainingArguments.max_steps ("overrides num_train_epochs"), the other way than
    test_number_of_steps_in_training's max_steps=10: 20 steps of one 8-step epoch go on into more."""
    _, _, result = _train(tmp_path, learning_rate=0.1, max_epochs=1, max_steps=20)
    assert result.global_step == 20


def test_training_loss(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_training_loss: with even
    logs the logged losses average to the run's training loss; uneven logs give the same training loss."""
    fitter, _, result = _train(tmp_path / "even", log_every=64 // 8)
    losses = [row["train/loss"] for row in fitter.state.log_history if "train/loss" in row]
    assert len(losses) == 3
    assert sum(losses) / len(losses) == pytest.approx(result.training_loss, abs=1e-4)
    _, _, uneven = _train(tmp_path / "uneven", log_every=5)
    assert uneven.training_loss == pytest.approx(result.training_loss, abs=1e-4)


def test_logging_steps(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_logging_inf_nan_filter
    (its finite half: logging_steps=1 over 3 epochs of 8 steps): one row per step, each with its epoch."""
    fitter, _, _ = _train(tmp_path, log_every=1)
    rows = [row for row in fitter.state.log_history if "train/loss" in row]
    assert [row["step"] for row in rows] == list(range(1, 25))
    assert rows[7]["train/epoch"] == pytest.approx(1.0)
    assert rows[-1]["train/epoch"] == pytest.approx(3.0)


@pytest.mark.xfail(strict=True, raises=ll.errors.NonFiniteLossError,
                   reason="docs/migrating.md: | non-finite losses | `logging_nan_inf_filter=True`")
def test_logging_inf_nan_filter(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_logging_inf_nan_filter:
    with non-finite losses (here one label is inf) the run finishes and the logged losses stay finite."""
    data = RegressionDataset()
    data.ys[0][3] = float("inf")
    fitter = regression_fitter(tmp_path, log_every=1)
    fitter.fit(RegressionModel(), data)
    losses = [row["train/loss"] for row in fitter.state.log_history if "train/loss" in row]
    assert all(math.isfinite(v) for v in losses)


def test_save_checkpoints(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_save_checkpoints:
    save_steps=5 over 24 steps writes checkpoint-5 ... checkpoint-20, each with weights, optimizer,
    scheduler and trainer state."""
    _train(tmp_path, save_every=5)
    for step in range(5, 24, 5):
        ckpt = tmp_path / f"checkpoint-{step}"
        assert ckpt.is_dir()
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
            assert (ckpt / name).is_file(), (step, name)


@pytest.mark.parametrize("checkpoint", ["checkpoint-5", "checkpoint-15"])
def test_can_resume_training(tmp_path, checkpoint):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_can_resume_training:
    128 samples, save_steps=5, lr 0.1; resuming from checkpoint-5 (and checkpoint-15, past an epoch's
    end) ends with the same a, b and state as the uninterrupted run (bit for bit here)."""
    kwargs = {"train_len": 128, "save_every": 5, "learning_rate": 0.1, "log_every": 5}
    fitter, m, _ = _train(tmp_path / "full", **kwargs)
    state = fitter.state.to_dict()
    again = regression_fitter(tmp_path / "full", save_every=5, learning_rate=0.1, log_every=5)
    m1 = RegressionModel()
    with pytest.warns(UserWarning, match="moved those"):  # the newer checkpoints are set aside, not overwritten
        again.fit(m1, RegressionDataset(length=128), resume=str(tmp_path / "full" / checkpoint))
    assert m1.a.item() == m.a.item() and m1.b.item() == m.b.item()
    state1 = again.state.to_dict()
    assert state1["global_step"] == state["global_step"] == 48
    for key in ("log_history", "epoch", "samples_seen", "best_metric"):
        assert state1[key] == state[key], key


def test_resume_training_with_gradient_accumulation(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_resume_training_with_gradient_accumulation:
    batch 4, accumulation 2, resumed from checkpoint-5: the same a, b."""
    kwargs = {"train_len": 128, "save_every": 5, "learning_rate": 0.1, "batch_size": 4, "grad_accum_steps": 2}
    _, m, _ = _train(tmp_path, **kwargs)
    again = regression_fitter(tmp_path, save_every=5, learning_rate=0.1, batch_size=4, grad_accum_steps=2)
    m1 = RegressionModel()
    with pytest.warns(UserWarning, match="moved those"):
        again.fit(m1, RegressionDataset(length=128), resume=str(tmp_path / "checkpoint-5"))
    assert (m1.a.item(), m1.b.item()) == (m.a.item(), m.b.item())


def _checkpoint_steps(path):
    return sorted(int(p.name.split("-")[1]) for p in path.glob("checkpoint-*"))


@pytest.mark.parametrize(("fields", "expected"), [
    ({"save_total_limit": 2}, [20, 25]),
    # best = the first evaluation: a loss counted as "greater is better" peaks at step 5
    ({"save_total_limit": 2, "metric_for_best": "loss", "greater_is_better": True}, [5, 25]),
    ({"save_total_limit": 1, "metric_for_best": "loss", "greater_is_better": False}, [25]),
    ({"save_total_limit": 1, "metric_for_best": "loss", "greater_is_better": True}, [5, 25]),
])
def test_checkpoint_rotation(tmp_path, fields, expected):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_checkpoint_rotation:
    checkpoints every 5 steps to 25; a limit of 2 keeps the last two, or the best and the last;
    a limit of 1 keeps the best too when it is not the last."""
    val = RegressionDataset(length=16, seed=1) if "metric_for_best" in fields else None
    _train(tmp_path, learning_rate=0.1, max_steps=25, save_every=5, val=val,
           eval_every=5 if val is not None else None, **fields)
    assert _checkpoint_steps(tmp_path) == expected


def _check_best_model_has_been_loaded(tmp_path, fitter, module, metric, greater_is_better):
    """``check_best_model_has_been_loaded``: the best of the logged evaluations is the checkpoint
    whose weights the module holds, and evaluating it gives that value."""
    evals = [row for row in fitter.state.log_history if metric in row]
    values = [row[metric] for row in evals]
    best_value = max(values) if greater_is_better else min(values)
    best_step = evals[values.index(best_value)]["step"]
    best = RegressionModel()
    best.load_weights(tmp_path / f"checkpoint-{best_step}")
    torch.testing.assert_close(best.a, module.a)
    torch.testing.assert_close(best.b, module.b)
    metrics = ll.Fitter(batch_size=8, **QUIET).validate(module, RegressionDataset())
    assert metrics[metric] == pytest.approx(best_value, rel=1e-6)


def test_load_best_model_at_end(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_load_best_model_at_end
    (eval_loss): a=1.5, b=2.5, eval and save every 5 steps, load_best_model_at_end: lower is better."""
    fitter = regression_fitter(tmp_path, learning_rate=0.1, eval_every=5, save_every=5, load_best_at_end=True,
                               metric_for_best="loss")
    module = RegressionModel(a=1.5, b=2.5)
    fitter.fit(module, RegressionDataset(), RegressionDataset())
    for step in range(5, 24, 5):
        assert (tmp_path / f"checkpoint-{step}").is_dir()
    _check_best_model_has_been_loaded(tmp_path, fitter, module, "val/loss", greater_is_better=False)


def test_load_best_model_at_end_with_accuracy(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_load_best_model_at_end
    (compute_metrics=AlmostAccuracy, metric_for_best_model="accuracy"): greater is better."""
    from peers_common import AlmostAccuracy

    fitter = regression_fitter(tmp_path, learning_rate=0.1, eval_every=5, save_every=5, load_best_at_end=True,
                               metric_for_best="accuracy")
    module = RegressionModel(a=1.5, b=2.5)
    module.compute_metrics = AlmostAccuracy()
    fitter.fit(module, RegressionDataset(), RegressionDataset())
    _check_best_model_has_been_loaded(tmp_path, fitter, module, "val/accuracy", greater_is_better=True)


def test_load_best_model_at_end_epochs(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_load_best_model_at_end
    (eval_strategy="epoch", save_strategy="epoch")."""
    fitter = regression_fitter(tmp_path, learning_rate=0.1, eval_on_epoch_end=True, save_strategy="epoch",
                               load_best_at_end=True, metric_for_best="loss")
    module = RegressionModel(a=1.5, b=2.5)
    fitter.fit(module, RegressionDataset(), RegressionDataset())
    assert _checkpoint_steps(tmp_path) == [8, 16, 24]
    _check_best_model_has_been_loaded(tmp_path, fitter, module, "val/loss", greater_is_better=False)


def test_early_stopping_callback(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_early_stopping_callback:
    20 epochs of batch 16, evaluated and saved each epoch, EarlyStoppingCallback(1, 0.0001) on
    accuracy: the run stops before 20 * 64 / 16 steps."""
    from peers_common import AlmostAccuracy

    module = RegressionModel()
    module.compute_metrics = AlmostAccuracy()
    stopper = ll.EarlyStopping(monitor="val/accuracy", patience=1, min_delta=0.0001, mode="max")
    fitter = regression_fitter(tmp_path, max_epochs=20, batch_size=16, load_best_at_end=True, eval_on_epoch_end=True,
                               save_strategy="epoch", metric_for_best="accuracy", callbacks=[stopper])
    result = fitter.fit(module, RegressionDataset(), RegressionDataset())
    assert result.global_step < 20 * 64 / 16
    assert stopper.stopped_step == result.global_step


class RegressionRandomModel(RegressionModel):
    """``RegressionRandomPreTrainedModel``: the output takes noise from torch, numpy and Python's
    random streams."""

    def forward(self, batch):
        import random

        import numpy as np

        noise = 0.05 * torch.randn(1).squeeze() + 0.05 * torch.tensor(np.random.rand() + random.random())
        return batch["input_x"] * self.a + self.b + noise


def test_resume_training_with_randomness(tmp_path):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationTest::test_resume_training_with_randomness:
    a model drawing from torch, numpy and random, saved every 5 of 24 steps at lr 0.1, resumed from
    checkpoint-15: the same a, b (the original: within 1e-5; here exactly)."""
    _, m, _ = _train(tmp_path, model=RegressionRandomModel(), save_every=5, learning_rate=0.1)
    again = regression_fitter(tmp_path, save_every=5, learning_rate=0.1)
    m1 = RegressionRandomModel()
    with pytest.warns(UserWarning, match="moved those"):
        again.fit(m1, RegressionDataset(), resume=str(tmp_path / "checkpoint-15"))
    assert (m1.a.item(), m1.b.item()) == (m.a.item(), m.b.item())


def test_trainer_with_datasets(tmp_path, default_trained):
    """transformers tests/trainer/test_trainer.py::TrainerIntegrationPrerunTest::test_trainer_with_datasets:
    the regression data as a ``datasets.Dataset`` (numpy rows, then torch format, then with a column
    the model does not use) trains the model of test_reproducible_training."""
    import datasets
    import numpy as np

    (a, b), _ = default_trained
    data = RegressionDataset()
    np.random.seed(0)
    z = np.random.normal(size=(64,)).astype(np.float32)
    sets = [datasets.Dataset.from_dict({"input_x": data.x, "labels": data.ys[0]})]
    sets.append(sets[0].with_format("torch", dtype=torch.float32))
    sets.append(datasets.Dataset.from_dict({"input_x": data.x, "labels": data.ys[0], "extra": z}))
    for i, train in enumerate(sets):
        module = RegressionModel()
        regression_fitter(tmp_path / str(i), learning_rate=0.1).fit(module, train)
        assert torch.allclose(module.a, a) and torch.allclose(module.b, b), i

"""Resume reproduces the uninterrupted run: weights and logged loss history, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params
from torch import nn

import lightlike as ll


class Dropout(Classifier):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, batch):
        return self.net(self.drop(batch["x"]))


class StopAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            raise KeyboardInterrupt  # like a kill right after the step's checkpoint


def run(out, stop=None, resume=None, **kw):
    cfg = dict(max_steps=14, batch_size=4, grad_accum_steps=2, save_every=2, log_every=2, eval_every=5,
               output_dir=str(out), loggers=["csv"], learning_rate=1e-2, warmup_steps=2)
    cfg.update(kw)
    torch.manual_seed(0)
    model = Dropout()
    fitter = ll.Fitter(callbacks=[StopAt(stop)] if stop else [], **cfg)
    try:
        result = fitter.fit(model, DictDataset(n=22), DictDataset(n=6, seed=9), resume=resume)
    except KeyboardInterrupt:
        return model, None
    return model, result


def loss_history(result):
    return [(h["step"], h.get("train/loss"), h.get("val/loss")) for h in result.state.log_history]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stop", [3, 5, 8, 11])
def test_resume_is_bit_identical(tmp_path, precision, stop):
    ref_model, ref = run(tmp_path / "ref", precision=precision)
    run(tmp_path / "cut", stop=stop, precision=precision)
    model, result = run(tmp_path / "cut", resume=True, precision=precision)
    assert result.global_step == 14
    assert torch.equal(flat_params(model), flat_params(ref_model))
    assert loss_history(result) == loss_history(ref)
    assert result.training_loss == ref.training_loss
    from lightlike.loggers.csv import read_csv_metrics

    assert read_csv_metrics(tmp_path / "cut" / "logs" / "metrics.csv") == read_csv_metrics(
        tmp_path / "ref" / "logs" / "metrics.csv")


def test_resume_from_path_and_changed_settings_warn(tmp_path, caplog):
    run(tmp_path / "a", stop=7)
    with caplog.at_level("WARNING", logger="lightlike"):
        _, result = run(tmp_path / "a", resume=str(tmp_path / "a" / "checkpoint-4"), learning_rate=5e-3,
                        overwrite_output_dir=True)
    assert result.global_step == 14
    assert "no longer a pure continuation" in caplog.text and "learning_rate: 0.01 -> 0.005" in caplog.text

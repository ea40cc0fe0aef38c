"""A finite loss with a NaN/inf gradient (``sqrt`` at 0) never reaches a checkpoint, nor, under
``nonfinite_loss="skip"``, the weights; a fit whose every step was skipped does not succeed.
Multi-process versions: tests/strategies/test_ddp.py, test_fsdp.py, test_deepspeed.py
(``test_a_nan_gradient_on_one_rank_*``)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import Classifier, DictDataset, InfiniteGradient

import lightlike as ll
from lightlike.checkpoint.manifest import verify_checkpoint
from lightlike.checkpoint.weights import load_safetensors
from lightlike.precision import MixedPrecision


class NaNGradientAt(Classifier):
    """A finite loss whose gradient is NaN at the training steps in ``bad`` (one micro-batch per
    step): ``0 * sqrt(|o - o.detach()|)`` is 0, its derivative 0 * inf = NaN. ``bad_loss``: steps
    whose loss is NaN outright."""

    bad: set[int] = set()
    bad_loss: set[int] = set()

    def __init__(self):
        super().__init__()
        self.calls = 0

    def loss(self, outputs, batch):
        loss = super().loss(outputs, batch)
        if not self.training:
            return loss
        self.calls += 1
        if self.calls in self.bad_loss:
            loss = loss * float("nan")
        if self.calls in self.bad:
            loss = loss + 0.0 * (outputs - outputs.detach()).abs().sqrt().sum()
        return loss


def model_with(bad=(), bad_loss=()):
    torch.manual_seed(0)
    model = NaNGradientAt()
    model.bad, model.bad_loss = set(bad), set(bad_loss)
    return model


def fitter(out, **kw):
    cfg = dict(max_steps=5, batch_size=4, shuffle=False, learning_rate=1e-2, lr_scheduler="constant",
               output_dir=str(out), loggers=[], model_summary=False)
    cfg.update(kw)
    return ll.Fitter(**cfg)


def test_a_nan_gradient_raises_naming_its_step_and_no_checkpoint_follows_it(tmp_path):
    """The loss is finite at every step, its gradient NaN at step 3: the optimizer stepped with it
    and checkpoint-3 held NaN weights that passed verification. Now the read before the save of
    step 3 raises, naming step 3 and the gradient; checkpoints 1 and 2 exist, finite, nothing after."""
    out = tmp_path / "run"
    with pytest.raises(ll.NonFiniteGradientError, match="non-finite gradient at optimizer step 3") as error:
        fitter(out, save_every=1).fit(model_with(bad={3}), DictDataset(n=40))
    assert error.value.step == 3 and isinstance(error.value, ll.NonFiniteLossError)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    verify_checkpoint(out / "checkpoint-2")
    assert all(torch.isfinite(v).all() for v in load_safetensors(out / "checkpoint-2" / "model.safetensors").values())


def test_the_first_non_finite_step_is_named_be_it_loss_or_gradient(tmp_path):
    """Read once at the end (no save, no log step before it): a NaN gradient at step 2 comes
    before a NaN loss at step 4 and is the one named; a NaN loss (whose gradient is NaN too) is
    named as the loss, with its micro-batch."""
    no_reads = dict(log_every=100, save_strategy="no")
    with pytest.raises(ll.NonFiniteGradientError, match="step 2"):
        fitter(tmp_path / "a", **no_reads).fit(model_with(bad={2}, bad_loss={4}), DictDataset(n=40))
    with pytest.raises(ll.NonFiniteLossError, match="non-finite training loss .* at optimizer step 2, micro-batch 0"):
        fitter(tmp_path / "b", **no_reads).fit(model_with(bad={3}, bad_loss={2}), DictDataset(n=40))


class Without(torch.utils.data.Dataset):
    """DictDataset(n=20) without items 4..7 (step 2's batch of 4, in order)."""

    def __init__(self):
        self.data = DictDataset(n=20)
        self.keep = [i for i in range(20) if not 4 <= i < 8]

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, i):
        return self.data[self.keep[i]]


def test_skip_leaves_the_weights_of_a_run_without_the_bad_step(tmp_path, caplog):
    """'skip': the step with the NaN gradient is not applied (it was: NaN weights, and the fit
    returned as a success): the weights equal, bit for bit, those of a run that never saw its
    batch; it is counted and a warning names the step and the gradient."""
    model = model_with(bad={2})
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        result = fitter(tmp_path / "skip", max_steps=4, nonfinite_loss="skip", log_every=1).fit(
            model, DictDataset(n=20))
    reference = model_with()
    fitter(tmp_path / "ref", max_steps=3).fit(reference, Without())
    assert result.skipped_steps == 1 and result.global_step == 4
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert "non-finite gradient (the loss was finite) at step 2: step skipped" in caplog.text
    rows = {h["step"]: h for h in result.state.log_history if "train/loss" in h}
    assert "train/grad_norm" not in rows[2] and all("train/grad_norm" in rows[s] for s in (1, 3, 4))


def test_a_fit_whose_every_step_was_skipped_raises(tmp_path):
    """Every step's gradient NaN under 'skip': the fit returned as a success with the weights it
    started from; now it raises, saying so (and each step was counted)."""
    model = model_with(bad=range(1, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f = fitter(tmp_path, max_steps=3, nonfinite_loss="skip")
    with pytest.raises(ll.AllStepsSkippedError, match=r"all 3 optimizer steps of this fit were skipped "
                                                      r"\(non-finite gradient: 3\)"):
        f.fit(model, DictDataset(n=20))
    assert f.state.skipped_steps == 3
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_clipping_by_value_does_not_hide_an_infinite_gradient(tmp_path):
    """max_grad_value clamps an inf gradient to a finite value: the norm taken after it was
    finite and the fit succeeded with a gradient that had been inf. The norm before the clamp is
    the one checked."""
    with pytest.raises(ll.NonFiniteGradientError, match="step 1: the global gradient norm was inf "):
        fitter(tmp_path, max_steps=2, max_grad_value=1.0, learning_rate=0.0).fit(InfiniteGradient(), DictDataset(n=8))


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_under_16_mixed_a_nan_gradient_is_the_scalers_overflow_counted_once(tmp_path, policy, caplog):
    """16-mixed: the GradScaler skips a step whose gradients hold NaN and halves its scale; that
    is its overflow handling, under either policy: no error, one skipped step (not two), no
    warning of the loop's own, the scale halved once."""
    precision = MixedPrecision("16")
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        result = fitter(tmp_path, max_steps=4, precision=precision, nonfinite_loss=policy, log_every=1).fit(
            model_with(bad={2}), DictDataset(n=20))
    assert result.skipped_steps == 1
    assert precision.scaler.get_scale() == 2.0 ** 15
    assert "non-finite" not in caplog.text


def test_under_16_mixed_a_skipped_nan_loss_leaves_the_scaler_as_it_was(tmp_path):
    """'skip' under 16-mixed: the loop's skip of a NaN loss comes after the scaler unscaled the
    step's gradients; the scaler forgets that step (its next unscale_ raised otherwise) and keeps
    its scale (not an overflow of its own)."""
    precision = MixedPrecision("16")
    result = fitter(tmp_path, max_steps=4, precision=precision, nonfinite_loss="skip").fit(
        model_with(bad_loss={2}), DictDataset(n=20))
    assert result.skipped_steps == 1
    assert precision.scaler.get_scale() == 2.0 ** 16

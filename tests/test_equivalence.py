"""The Fitter against a hand-written PyTorch loop: bit-identical weights."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params
from torch.utils.data import DataLoader

import lightlike as ll
from lightlike.data.sampler import epoch_permutation


def hand_written_loop(model, data, *, steps, batch_size, lr, warmup, seed, weight_decay=0.0):
    """What a user would write by hand: AdamW (no decay on biases), linear warmup/decay, shuffled
    batches from a generator seeded with seed + epoch, as lightlike documents."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr)

    def lam(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (steps - step) / max(1, steps - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    torch.manual_seed(seed)
    step, epoch = 0, 0
    while step < steps:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
        loader = DataLoader(torch.utils.data.Subset(data, order.tolist()), batch_size=batch_size)
        for batch in loader:
            out = model(batch)
            loss = model.loss(out, batch)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == steps:
                break
        epoch += 1
    return model


@pytest.mark.parametrize("steps", [1, 7, 20])
def test_bit_identical_to_hand_written_loop(tmp_path, steps):
    data = DictDataset(n=50)
    torch.manual_seed(123)
    ours = Classifier()
    torch.manual_seed(123)
    ref = Classifier()
    assert torch.equal(flat_params(ours), flat_params(ref))

    fitter = ll.Fitter(max_steps=steps, batch_size=8, learning_rate=1e-2, warmup_steps=3,
                       weight_decay=0.1, output_dir=str(tmp_path / "run"), seed=5, loggers=[],
                       model_summary=False, accelerator="cpu")
    result = fitter.fit(ours, data)
    hand_written_loop(ref, data, steps=steps, batch_size=8, lr=1e-2, warmup=3, seed=5, weight_decay=0.1)

    assert result.global_step == steps
    assert torch.equal(flat_params(ours), flat_params(ref)), "weights differ from the hand-written loop"


def test_permutation_is_documented_function():
    assert torch.equal(epoch_permutation(10, 3, 2, True),
                       torch.randperm(10, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(epoch_permutation(10, 3, 2, False), torch.arange(10))


def test_epochs_and_training_loss(tmp_path):
    data = DictDataset(n=20)
    fitter = ll.Fitter(max_epochs=3, batch_size=8, output_dir=str(tmp_path), loggers=[], log_every=1,
                       model_summary=False)
    result = fitter.fit(Classifier(), data)
    assert result.global_step == 3 * math.ceil(20 / 8)
    losses = [h["train/loss"] for h in result.state.log_history if "train/loss" in h]
    assert len(losses) == result.global_step
    # the fit's training loss is the item-weighted mean over every logged step
    # (batches of 8, 8, 4 items per epoch)
    weights = [8, 8, 4] * 3
    expected = sum(l * w for l, w in zip(losses, weights)) / sum(weights)
    assert result.training_loss == pytest.approx(expected, rel=1e-6)
    assert result.state.epoch == pytest.approx(3.0)

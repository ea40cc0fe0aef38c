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
    """What a user would write by hand: fused AdamW (no decay on biases), linear warmup/decay, shuffled
    batches from a generator seeded with seed + epoch, as lightlike documents."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, fused=True)

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
    expected = sum(x * w for x, w in zip(losses, weights, strict=True)) / sum(weights)
    assert result.training_loss == pytest.approx(expected, rel=1e-6)
    assert result.state.epoch == pytest.approx(3.0)


@pytest.mark.parametrize("clip", [{"max_grad_norm": 0.05}, {"max_grad_value": 0.01},
                                  {"max_grad_norm": 0.05, "max_grad_value": 0.01}])
def test_clipping_matches_hand_written(tmp_path, clip):
    """Clipping by value then by global norm, on the true gradients, as torch's utilities do."""
    data = DictDataset(n=24)
    torch.manual_seed(1)
    ours = Classifier()
    torch.manual_seed(1)
    ref = Classifier()
    norms = []

    class Norms(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            norms.append(metrics.get("train/grad_norm"))

    ll.Fitter(max_steps=3, batch_size=8, shuffle=False, learning_rate=1e-2, lr_scheduler="constant", log_every=1,
              output_dir=str(tmp_path), loggers=[], callbacks=[Norms()], **clip).fit(ours, data)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    ref_norms = []
    for step in range(3):
        batch = {k: torch.stack([data[i][k] for i in range(8 * step, 8 * step + 8)]) for k in ("x", "y", "w")}
        ref.loss(ref(batch), batch).backward()
        if "max_grad_value" in clip:
            torch.nn.utils.clip_grad_value_(ref.parameters(), clip["max_grad_value"])
        if "max_grad_norm" in clip:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip["max_grad_norm"]).item())
        else:
            ref_norms.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item())
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(flat_params(ours), flat_params(ref), rtol=1e-6, atol=1e-7)
    assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_eval_on_epoch_end(tmp_path):
    seen = []

    class Evals(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            seen.append((state.global_step, round(state.epoch, 6)))

    ll.Fitter(max_epochs=3, batch_size=4, eval_on_epoch_end=True, output_dir=str(tmp_path), loggers=[],
              callbacks=[Evals()]).fit(Classifier(), DictDataset(n=10), DictDataset(n=4))
    assert seen == [(3, 1.0), (6, 2.0), (9, 3.0)]  # 3 batches per epoch; no extra eval at the end

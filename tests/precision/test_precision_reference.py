"""mixed/half precision against hand-written torch loops and torch's defaults."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import Classifier, DictDataset, stacked_batches
from torch import nn

import lightlike as ll
from lightlike.precision import HalfPrecision, MixedPrecision, get_precision


def _reference_16_mixed(model, steps, bs, lr, max_norm=None, max_value=None):
    """torch's documented AMP recipe: autocast(float16), scale, backward, unscale_, clip, step, update."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    for batch in list(stacked_batches(steps * bs, bs)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(model(batch), batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if max_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), max_value)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return scaler


@pytest.mark.parametrize("clip", [{}, {"max_grad_norm": 0.05}, {"max_grad_value": 0.01}])
def test_16_mixed_matches_torch_amp_recipe_and_its_default_scaler(tmp_path, clip):
    torch.manual_seed(0)
    model = Classifier()
    ref = copy.deepcopy(model)
    precision = MixedPrecision("16")  # the plugin's defaults
    ll.Fitter(precision=precision, max_steps=3, batch_size=8, shuffle=False, optimizer="sgd", learning_rate=0.1,
              lr_scheduler="constant", accelerator="cpu", output_dir=str(tmp_path), loggers=[], model_summary=False,
              save_strategy="no", **clip).fit(model, DictDataset(n=24))
    scaler = _reference_16_mixed(ref, 3, 8, 0.1, clip.get("max_grad_norm"), clip.get("max_grad_value"))
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=name)
    # the loss scale and its schedule are torch's GradScaler defaults (2**16, growth every 2000 steps)
    assert precision.state_dict()["scaler"] == scaler.state_dict()
    assert scaler.state_dict()["scale"] == 2.0**16 and scaler.state_dict()["growth_interval"] == 2000


def test_bf16_mixed_matches_a_hand_written_autocast_loop(tmp_path):
    torch.manual_seed(0)
    model = Classifier()
    ref = copy.deepcopy(model)
    ll.Fitter(precision="bf16-mixed", max_steps=2, batch_size=8, shuffle=False, optimizer="sgd", learning_rate=0.1,
              lr_scheduler="constant", accelerator="cpu", output_dir=str(tmp_path), loggers=[], model_summary=False,
              save_strategy="no").fit(model, DictDataset(n=16))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for batch in stacked_batches(16, 8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref.loss(ref(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)


def test_precision_names_follow_lightning():
    # Lightning 2.x: "16" / "fp16" mean 16-mixed, "bf16" bf16-mixed, "32" / "fp32" 32-true
    assert [get_precision(n).name for n in ("16", "fp16", "bf16", "32", "fp32", "auto")] == \
        ["16-mixed", "16-mixed", "bf16-mixed", "32-true", "32-true", "32-true"]
    assert get_precision("16").uses_scaler and not get_precision("bf16").uses_scaler


@pytest.mark.parametrize("cls", [MixedPrecision, HalfPrecision])
@pytest.mark.parametrize("bad", ["32", "fp16", "bf16-mixed", "8"])
def test_precision_plugins_refuse_other_dtypes(cls, bad):
    with pytest.raises(ValueError, match="dtype must be 'bf16' or '16'"):
        cls(bad)


def test_true_half_leaves_integer_parameters_alone():
    class WithSteps(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.table = nn.Parameter(torch.tensor([3, 70000], dtype=torch.int64), requires_grad=False)

    for name, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16)):
        m = get_precision(name).convert_module(WithSteps())
        assert m.lin.weight.dtype == dtype
        assert m.table.dtype == torch.int64 and m.table.tolist() == [3, 70000]  # 70000 is inf in fp16

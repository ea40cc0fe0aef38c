"""The optimizers that run on CUDA only (bitsandbytes' paged ones, GaLore's 8-bit AdamW, AdaLOMO),
on a GPU: ``LIGHTLIKE_TEST_GPU=1 pytest tests/gpu/test_optimizer_libs_cuda.py`` (skipped without
one). Each trains as its library used by hand in a hand-written CUDA loop (weights torch.equal),
and a killed fit resumed from its checkpoint reaches the uninterrupted fit's weights bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

import lightlike as ll
from tests.helpers import StopAt, flat_params
from tests.optim.test_optimizer_libs import BATCH, LR, STEPS, data, hand_groups, linear, settings, wide

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device, left visible by LIGHTLIKE_TEST_GPU=1")
CUDA = torch.device("cuda")


def hand_optimizer(name: str, model):
    import bitsandbytes.optim as bnb

    betas, eps = (0.9, 0.999), 1e-8
    if name.startswith("paged_"):
        cls = bnb.AdamW if "adamw" in name else bnb.Lion
        extra = {"eps": eps} if "adamw" in name else {}
        return cls(hand_groups(model, name), lr=LR, betas=betas, optim_bits=8 if "8bit" in name else 32,
                   is_paged=True, **extra)
    if name == "galore_adamw_8bit":
        import galore_torch
        return galore_torch.GaLoreAdamW8bit(hand_groups(model, name), lr=LR, betas=betas, eps=eps)
    from lomo_optim import AdaLomo
    return AdaLomo(model, lr=LR)


NAMES = ["paged_adamw_8bit", "paged_adamw_32bit", "paged_lion_8bit", "paged_lion_32bit", "galore_adamw_8bit",
         "adalomo"]


def cuda_settings(name: str, **kw) -> dict:
    cfg = settings(name, accelerator="cuda", **kw)
    if name == "adalomo":
        cfg["weight_decay"] = 0.0
    return cfg


@pytest.mark.parametrize("name", NAMES)
def test_each_cuda_optimizer_trains_as_its_library_by_hand(name, tmp_path):
    fitter = ll.Fitter(output_dir=str(tmp_path), **cuda_settings(name))
    fitter.fit(model := wide(), data())
    ref = wide().to(CUDA)
    opt = hand_optimizer(name, ref)
    sched = LambdaLR(opt, linear(1, STEPS))
    for batch in DataLoader(data(), batch_size=BATCH):
        batch = {k: v.to(CUDA) for k, v in batch.items()}
        loss = ref.loss(ref(batch), batch)
        if name == "adalomo":
            opt.fused_backward(loss, sched.get_last_lr()[0])
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()
    assert torch.equal(flat_params(model), flat_params(ref))


@pytest.mark.parametrize("name", NAMES)
def test_each_cuda_optimizer_resumes_bit_exactly(name, tmp_path):
    cfg = cuda_settings(name, save_every=2)
    ll.Fitter(output_dir=str(tmp_path / "whole"), **cfg).fit(ref := wide(), data())
    with contextlib.suppress(KeyboardInterrupt):
        ll.Fitter(output_dir=str(tmp_path / "cut"), callbacks=[StopAt(3)], **cfg).fit(wide(), data())
    ll.Fitter(output_dir=str(tmp_path / "cut"), **cfg).fit(model := wide(), data(), resume=True)
    assert torch.equal(flat_params(model), flat_params(ref))

"""Manual optimization (a module with ``training_step(batch, ctx)``): against a hand-written loop,
bit for bit; several optimizers and schedulers; precision; resume; what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import GAN, MixtureDataset, StopAt, flat_params, hand_written_gan

import lightlike as ll
from lightlike.errors import ConfigError, ModuleContractError


def fitter(tmp_path, name="run", **kw):
    kw = {"max_steps": 7, "batch_size": 8, "shuffle": False, "seed": 0, "loggers": [], "model_summary": False,
          "accelerator": "cpu", "output_dir": str(tmp_path / name), **kw}
    return ll.Fitter(**kw)


@pytest.mark.parametrize("steps", [1, 11])
def test_gan_bit_identical_to_hand_written_loop(tmp_path, steps):
    data = MixtureDataset(n=40)
    torch.manual_seed(3)
    ours = GAN()
    ref = copy.deepcopy(ours)
    result = fitter(tmp_path, max_steps=steps).fit(ours, data)
    opts = hand_written_gan(ref, data, steps=steps, batch_size=8)
    assert torch.equal(flat_params(ours), flat_params(ref))
    assert not torch.equal(flat_params(ours), flat_params(copy.deepcopy(GAN())))
    assert result.global_step == steps
    for a, b in zip(result and ours.configure_optimizers(None), opts, strict=True):  # same kinds
        assert type(a) is type(b)

"""Optimizer set-up the rest of the suite left open (mutation testing, audit round 10): a 2-D
parameter named bias not decayed, complex parameters not sent to the fused kernel, Lightning's
two-scheduler form refused."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier
from torch import nn

from lightlike.config import FitConfig
from lightlike.errors import ModuleContractError
from lightlike.optim import build_optimizer, param_groups, unwrap_configure_optimizers


def config(**kw):
    return FitConfig(**{"max_steps": 10, **kw})


def test_a_parameter_named_bias_is_not_decayed_whatever_its_shape():
    class TwoDBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3, 4))
            self.bias = nn.Parameter(torch.zeros(2, 3))  # a bias table, 2-D

    module = TwoDBias()
    decay, no_decay = param_groups(module, 0.1)
    assert decay["params"] == [module.weight] and no_decay["params"] == [module.bias]


def test_complex_parameters_do_not_get_the_fused_kernel_by_default():
    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, dtype=torch.complex64))

    module = Complex()
    opt = build_optimizer(module, config())
    assert not opt.defaults.get("fused")
    module.w.grad = torch.ones_like(module.w)
    opt.step()  # runs
    assert torch.isfinite(torch.view_as_real(module.w.detach())).all()


def test_lightnings_two_scheduler_form_is_refused():
    """([optimizer], [s1, s2]): lightlike steps one scheduler; the second is not dropped silently."""
    opt = torch.optim.SGD(Classifier().parameters(), lr=1e-3)
    s1 = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    s2 = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert unwrap_configure_optimizers(([opt], [s1])) == (opt, s1)
    with pytest.raises(ModuleContractError, match="configure_optimizers returned"):
        unwrap_configure_optimizers(([opt], [s1, s2]))

"""Strategy set-up against its environment: inconsistent launches, devices, per-rank logging and
the DDP options reaching DistributedDataParallel."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import Classifier, DictDataset
from torch.nn.parallel import DistributedDataParallel

import lightlike as ll
from lightlike.loggers.console import setup_logging
from lightlike.strategies.ddp import DDPStrategy


@pytest.fixture
def plain_env(monkeypatch):
    """No launcher variables from the outer environment."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "GROUP_RANK")):
            monkeypatch.delenv(k)


def fitter(tmp_path, **kw):
    cfg = dict(max_steps=1, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False)
    return ll.Fitter(**{**cfg, **kw})


def test_single_strategy_with_world_size_alone(tmp_path, plain_env, monkeypatch):
    """WORLD_SIZE=4 without RANK/LOCAL_RANK used to run one process silently."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ll.ConfigError, match="strategy='single' but WORLD_SIZE=4.*strategy='ddp'.*unset WORLD_SIZE"):
        fitter(tmp_path, strategy="single").fit(Classifier(), DictDataset())
    with pytest.raises(ll.ConfigError, match="WORLD_SIZE=4 is set but RANK and LOCAL_RANK are not"):
        fitter(tmp_path, strategy="auto").fit(Classifier(), DictDataset())


def test_ddp_cuda_without_cuda_says_so(plain_env):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ll.ConfigError, match="accelerator='cuda' but CUDA is not available here.*accelerator='cpu'"):
        DDPStrategy(accelerator="cuda").setup_environment()
    with pytest.raises(ll.ConfigError, match="'cuda:1' names one device.*accelerator='cuda'"):
        DDPStrategy(accelerator="cuda:1").setup_environment()


def test_log_level_of_other_ranks_is_configurable():
    try:
        assert setup_logging("info", False).level == 30  # the default: WARNING elsewhere
        assert setup_logging("info", False, "info").level == 20
        assert setup_logging("debug", False, "error").level == 40
        assert setup_logging("debug", True, "error").level == 10
        with pytest.raises(ll.ConfigError, match="log_level_other_ranks='loud'"):
            setup_logging("info", False, "loud")
    finally:
        setup_logging("info", True)
    assert ll.FitConfig(max_steps=1).log_level_other_ranks == "warning"
    assert ll.FitConfig(max_steps=1, log_level_other_ranks="DEBUG").log_level_other_ranks == "DEBUG"
    with pytest.raises(ll.ConfigError, match="log_level_other_ranks='loud' is not valid.*debug, info"):
        ll.FitConfig(max_steps=1, log_level_other_ranks="loud")


OPTIONS = dict(find_unused_parameters=True, static_graph=False, gradient_as_bucket_view=True, bucket_cap_mb=1.5)
STATIC = dict(find_unused_parameters=False, static_graph=True, gradient_as_bucket_view=False, bucket_cap_mb=50.0)


def _ddp_settings(model):
    assert isinstance(model, DistributedDataParallel)
    return dict(find_unused_parameters=model.find_unused_parameters, static_graph=model.static_graph,
                gradient_as_bucket_view=model.gradient_as_bucket_view, bucket_cap_mb=model.bucket_bytes_cap / 2**20)


@pytest.mark.parametrize("options", [OPTIONS, STATIC])
def test_ddp_options_reach_distributed_data_parallel(plain_env, options):
    """Each DDPStrategy option is what DistributedDataParallel gets (a group of one over gloo)."""
    strategy = DDPStrategy(**options)
    strategy.setup_environment()
    try:
        assert _ddp_settings(strategy.setup_module(Classifier())) == options
    finally:
        strategy.teardown()


def test_ddp_options_by_instance_and_defaults_by_name(tmp_path, plain_env):
    """`strategy=DDPStrategy(...)` trains with its options; `strategy="ddp"` with torch's defaults,
    but for gradient_as_bucket_view=True (the gradients are views into DDP's buckets, not a copy
    beside them: the same weights, tests/strategies/test_compiled_strategies.py)."""
    f = fitter(tmp_path, strategy=DDPStrategy(**OPTIONS))
    assert f.fit(Classifier(), DictDataset(n=8)).global_step == 1
    assert _ddp_settings(f.model) == OPTIONS
    f = fitter(tmp_path, strategy="ddp", overwrite_output_dir=True)
    f.fit(Classifier(), DictDataset(n=8))
    assert _ddp_settings(f.model) == dict(find_unused_parameters=False, static_graph=False,
                                          gradient_as_bucket_view=True, bucket_cap_mb=25.0)


def test_fitter_sets_log_level_other_ranks(tmp_path, plain_env):
    """Needs fitter.py to pass ``cfg.log_level_other_ranks`` to ``setup_logging``."""
    class SecondRank(ll.strategies.SingleDeviceStrategy):
        is_global_zero = False  # type: ignore[assignment]

    try:
        f = fitter(tmp_path, strategy=SecondRank("cpu"), log_level_other_ranks="debug")
        f.setup_strategy()
        assert logging.getLogger("lightlike").level == logging.DEBUG
    finally:
        setup_logging("info", True)

"""BF mutation round: single-device strategy set-up and the CPU batch move."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightlike.errors import ConfigError
from lightlike.strategies.base import move_to_device
from lightlike.strategies.single import SingleDeviceStrategy, resolve_device


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
              "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("world", ["2", "8"])
def test_single_refuses_any_world_size_above_one(clean_env, world):
    clean_env.setenv("WORLD_SIZE", world)  # no RANK: a half-set launcher environment
    with pytest.raises(ConfigError, match=f"strategy='single' but WORLD_SIZE={world}.*strategy='ddp'"):
        SingleDeviceStrategy("cpu").setup_environment()


def test_single_accepts_world_size_one(clean_env):
    clean_env.setenv("WORLD_SIZE", "1")
    s = SingleDeviceStrategy("cpu")
    s.setup_environment()
    assert s.world_size == 1 and s.root_device == torch.device("cpu")


@pytest.mark.parametrize("acc", ["meta", "mps", "xpu", "hpu"])
def test_resolve_device_refuses_device_types_it_does_not_drive(acc):
    with pytest.raises(ConfigError, match="is not supported; use 'auto', 'cpu' or 'cuda'"):
        resolve_device(acc)


def test_move_to_device_leaves_classes_in_a_batch_alone():
    batch = {"x": torch.ones(2), "kind": nn.Linear, "dtype": torch.float16}
    out = move_to_device(batch, torch.device("cpu"))
    assert out["kind"] is nn.Linear and out["dtype"] is torch.float16 and torch.equal(out["x"], batch["x"])


def test_single_refuses_a_task_of_a_multi_task_srun_step(clean_env):
    # inside `srun --ntasks 2`: SLURM says this process is one of 2 (no WORLD_SIZE)
    for k, v in {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                 "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
                 "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "node1"}.items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigError, match="strategy='single' but SLURM_STEP_NUM_TASKS=2.*launch a single process"):
        SingleDeviceStrategy("cpu").setup_environment()


def test_every_batch_goes_through_batch_to_device_which_changes_nothing_it_need_not(clean_env, tmp_path):
    """On the CPU with no input cast, ``batch_to_device`` gives the batch back as it is; an input
    cast, or an overridden ``convert_input`` / ``batch_to_device``, is applied to every batch."""
    from helpers import Classifier, DictDataset

    import lightlike as ll
    from lightlike.precision import Precision, get_precision

    batch = {"x": torch.ones(2, 3), "y": torch.tensor([0, 1])}
    for name in ("32-true", "bf16-mixed"):
        assert SingleDeviceStrategy("cpu", precision=get_precision(name)).batch_to_device(batch) is batch
    cast = SingleDeviceStrategy("cpu", precision=get_precision("bf16-true")).batch_to_device(batch)
    assert cast["x"].dtype == torch.bfloat16 and cast["y"].dtype == torch.int64
    seen = []

    class Marking(Precision):  # a user's plugin that changes the inputs
        def convert_input(self, batch):
            seen.append(batch["x"].shape[0])
            return {**batch, "x": batch["x"] * 0}

    class Moving(SingleDeviceStrategy):
        def batch_to_device(self, batch):
            seen.append(-1)
            return super().batch_to_device(batch)

    fitter = ll.Fitter(strategy=SingleDeviceStrategy("cpu", precision=Marking()), max_steps=3, batch_size=4,
                       output_dir=str(tmp_path / "a"), loggers=[], model_summary=False, learning_rate=0.1)
    module = Classifier()
    first = [p.detach().clone() for p in module.net[0].parameters()]
    fitter.fit(module, DictDataset())
    assert seen == [4, 4, 4]
    # zero inputs: the first layer's weight gets no gradient (its bias does); the cast was applied
    assert torch.equal(module.net[0].weight, first[0]) and not torch.equal(module.net[0].bias, first[1])
    seen.clear()
    ll.Fitter(strategy=Moving("cpu"), max_steps=2, batch_size=4, output_dir=str(tmp_path / "b"), loggers=[],
              model_summary=False).fit(Classifier(), DictDataset())
    assert seen == [-1, -1]

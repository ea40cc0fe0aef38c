"""What evaluation leaves behind on several processes (torchrun, gloo, CPU), against one process:
module modes restored submodule by submodule, rank 0's BatchNorm statistics used by every rank
(the checkpoint's), a fit after validate() that trains, a set smaller than the world with
buffers. Found by audit round 5: FSDP's fit after validate() did not train; DDP hung on a
one-item set with BatchNorm; FSDP/ZeRO evaluated a mix of the ranks' statistics; DDP and
DeepSpeed returned an eval-mode module in train mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import DictDataset
from launching import launch

SCRIPT = Path(__file__).parents[1] / "scripts" / "eval_state_target.py"


def reference(state, n, seed, dtype=torch.float64):
    """One process, by hand: the model with the checkpoint's state (rank 0's statistics)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_state_target", SCRIPT)
    target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(target)
    model = target.Normed().double()
    model.load_state_dict(state)
    model.eval()
    data = DictDataset(n=n, dtype=dtype, seed=seed)  # drawn in the run's dtype, computed in float64
    with torch.no_grad():
        logits = model.net(model.norm(data.x.double()))
    return torch.nn.functional.cross_entropy(logits, data.y).item()


@pytest.mark.parametrize("nproc", [2, 3])
def test_predictions_of_a_dataset_that_shards_itself_come_back_rank_by_rank(tmp_path, nproc):
    """shards_itself=True in contiguous blocks (uneven, a rank left empty with 4 items on 3): the
    outputs are joined rank by rank; they were interleaved as if dealt round-robin ([0, 5, 1, 6,
    ...]), or failed to (3 processes, 4 items)."""
    p = launch(nproc, tmp_path, "self-sharded", script=SCRIPT, timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert result == {4: [0, 1, 2, 3], 10: list(range(10))}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_zero2"])
def test_evaluation_state_on_two_processes(tmp_path, strategy):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    p = launch(2, tmp_path, strategy, script=SCRIPT, timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["eval_mode_kept"] and r["mixed_modes_kept"]
        assert r["loss_after_validate"] == r["loss_plain"]
        # float32 under DeepSpeed (it refuses float64: its master weights are float32)
        dtype, tol = (torch.float32, 1e-6) if strategy.startswith("deepspeed") else (torch.float64, 1e-12)
        assert r["val"]["val/loss"] == pytest.approx(reference(ranks[0]["state"], 7, 1, dtype), rel=tol, abs=tol)
        assert r["tiny"]["val/loss"] == pytest.approx(reference(ranks[0]["state"], 1, 2, dtype), rel=tol, abs=tol)

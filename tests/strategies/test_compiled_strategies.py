"""compile=True under DDP and FSDP2, and DDP's gradients as bucket views, on real processes
(torchrun, gloo, CPU): the weights are those of the eager run."""

from __future__ import annotations

import pytest
import torch
from launching import assert_close, run_ok, weights

#: 2 ranks x 6 steps of 2 micro-batches of 4 items (48 items: every batch full, so the compiled
#: runs trace one shape), uneven item counts per micro-batch (token task), clipping
COMMON = ["--task", "token", "--accum", "2", "--steps", "6", "--items", "48", "--batch", "4", "--max-grad-norm", "0.5"]
#: FSDP2 with compile_regions: two blocks in an nn.ModuleList (shard units and compiled regions)
FSDP_REGIONS = [*COMMON[2:], "--task", "quiet-blocks", "--strategy", "fsdp"]
#: the eager runs the tests compare (DDP with gradients as bucket views and without, FSDP2 with
#: blocks), launched together by the first test that asks (one launch: ``shared_run.each``); the
#: compiled runs have a launch each (a fresh process: no compiled code from another run)
EAGER = [[*COMMON, "--strategy", "ddp"], [*COMMON, "--strategy", "ddp:no-bucket-view"], FSDP_REGIONS]


def eager(shared_run, args):
    return shared_run.each(2, *EAGER)[EAGER.index(args)]


def test_gradients_as_bucket_views_change_no_weight(shared_run):
    """DDPStrategy's default is now gradient_as_bucket_view=True (the gradients are views into
    DDP's buckets: 4 bytes per parameter less): the weights are those of torch's default (a
    copy beside the buckets), bit for bit, with accumulation and clipping."""
    views = eager(shared_run, [*COMMON, "--strategy", "ddp"])
    copies = eager(shared_run, [*COMMON, "--strategy", "ddp:no-bucket-view"])
    for rank in (0, 1):
        got, ref = weights(views, rank), weights(copies, rank)
        assert all(torch.equal(got[k], ref[k]) for k in ref), rank


@pytest.mark.slow
def test_compiled_ddp_trains_the_eager_weights(shared_run, tmp_path):
    """compile=True under DDP (torch's DDPOptimizer splits the forward at the bucket boundaries;
    the loss is compiled after DDP's own forward), with no_sync accumulation: the eager weights
    to 1e-10 (float64), the same on both ranks."""
    ref = eager(shared_run, [*COMMON, "--strategy", "ddp"])
    run_ok(2, tmp_path / "compiled", *COMMON, "--strategy", "ddp", "--compile", "step")
    got = [weights(tmp_path / "compiled", rank) for rank in (0, 1)]
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0]), "ranks disagree"
    assert_close(got[0], weights(ref), tol=1e-10)


@pytest.mark.slow
def test_compiled_fsdp_blocks_train_the_eager_weights(shared_run):
    """compile=True, compile_regions=True under FSDP2: each block compiled after fully_shard (as
    torchtitan does), the loss compiled: the eager FSDP run's weights to 1e-10 (float64)."""
    compiled = shared_run(2, *FSDP_REGIONS, "--compile", "regions")
    assert_close(weights(compiled), weights(eager(shared_run, FSDP_REGIONS)), tol=1e-10)


@pytest.mark.slow
def test_compiled_fsdp_blocks_with_activation_checkpointing_train_the_same_weights(shared_run, tmp_path):
    """compile=True, compile_regions=True and per-block activation checkpointing under FSDP2 (it
    was refused): each block checkpointed by torch's checkpoint_wrapper before fully_shard, then
    compiled (torchtitan's order): the weights of the same compiled FSDP fit without
    checkpointing (the test above's), bit for bit, with the wrappers in place of the blocks."""
    plain = shared_run(2, *FSDP_REGIONS, "--compile", "regions")
    run_ok(2, tmp_path / "ckpt", *FSDP_REGIONS, "--compile", "regions", "--gradient-checkpointing")
    assert (plain / "block-types.txt").read_text().split() == ["FSDPQuietBlock"] * 2
    assert (tmp_path / "ckpt" / "block-types.txt").read_text().split() == ["FSDPCheckpointWrapper"] * 2
    got, ref = weights(tmp_path / "ckpt"), weights(plain)
    assert list(got) == list(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []

"""Launching the test scripts as real processes (one plain process, or torchrun on gloo), and
reading back what they wrote. Shared by the multi-process tests of every folder."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch
from helpers import Classifier, run_killing_group

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DDP_TARGET = SCRIPTS / "ddp_target.py"

#: the uninterrupted 2-rank run whose final weights the resumes across world sizes (test_ddp.py,
#: test_fsdp.py) and the resume from rank 0's choice must reach; launched once for all (``shared_run``)
REF_8_STEPS = ["--steps", "8", "--items", "40", "--batch", "4", "--save-every", "2"]
#: the sharded run test_fsdp.py compares with DDP (checkpoints at 2, 4, 6 and the last, 7), which
#: the command line's export tests read too; launched once (``shared_run``)
FSDP_COMMON = ["--items", "46", "--accum", "2", "--max-grad-norm", "0.5", "--task", "token", "--steps", "7"]
FSDP_ARGS = ["--batch", "4", *FSDP_COMMON, "--save-every", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, out, *args, timeout=240, script=DDP_TARGET):
    """``script OUT ARGS`` as one plain process, or under torchrun with ``nproc`` processes."""
    out.mkdir(parents=True, exist_ok=True)
    if nproc == 1:
        cmd = [sys.executable, str(script), str(out), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(out), *args]
    return run_killing_group(cmd, timeout=timeout)


def launch_each(nproc, runs, timeout=240, script=DDP_TARGET):
    """Several runs ``[(out, args), ...]`` of ``script`` in one launch, one after another in the
    same processes (``OUT ARGS --then OUT ARGS ...``; ddp_target.py and manual_target.py): each
    writes what a launch of its own writes, into its own ``out``. For runs that end normally
    (a kill or a failure only in the last). The timeout is per run."""
    argv: list[str] = []
    for out, args in runs:
        out.mkdir(parents=True, exist_ok=True)
        argv += [*(["--then"] if argv else []), str(out), *args]
    return launch(nproc, Path(argv[0]), *argv[1:], timeout=timeout * len(runs), script=script)


def run_each_ok(nproc, runs, script=DDP_TARGET):
    p = launch_each(nproc, runs, script=script)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def run_ok(nproc, out, *args, script=DDP_TARGET):
    p = launch(nproc, out, *args, script=script)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def weights(out, rank=0):
    return torch.load(out / f"final-rank{rank}.pt", weights_only=True)


def assert_close(a, b, tol=1e-12):
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def moved_share(got, ref, width):
    """How far ``got`` is from ``ref`` as a share of how far training moved ``ref`` from the
    script's initial weights (``torch.manual_seed(0); Classifier(width=width)``): untrained weights
    score 1. Also the largest element move, to show the initial weights are the run's."""
    torch.manual_seed(0)
    init = Classifier(width=width).state_dict()
    moved = torch.cat([(ref[k].float() - init[k]).reshape(-1) for k in ref])
    err = torch.cat([(got[k].float() - ref[k].float()).reshape(-1) for k in ref])
    return (err.norm() / moved.norm()).item(), moved.abs().max().item()


STREAMS = SCRIPTS / "rank_streams_target.py"


def check_nan_gradient_on_one_rank(tmp_path, strategy):
    """``rank_streams_target.py nangrad``: a finite loss whose gradient is NaN on rank 1 only, at
    step 3 of 4, a checkpoint after every step. 'skip': every rank skips step 3 (one skip each; the
    weights finite, the same on both ranks, every checkpoint written); 'raise': every rank fails
    naming step 3 and the gradient, and no checkpoint follows checkpoint-2."""
    skip = tmp_path / "skip"
    p = launch(2, skip, "nangrad", "skip", strategy, script=STREAMS)
    assert p.returncode == 0, p.stderr[-4000:]
    for rank in (0, 1):
        assert json.loads((skip / f"result-rank{rank}.json").read_text())["skipped"] == 1, rank
        assert all(torch.isfinite(v).all() for v in weights(skip, rank).values()), rank
    assert_close(weights(skip, 0), weights(skip, 1), tol=0)
    assert sorted(c.name for c in skip.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    stopped = tmp_path / "raise"
    p = launch(2, stopped, "nangrad", "raise", strategy, script=STREAMS)
    assert p.returncode != 0
    for rank in (0, 1):
        error = stopped / f"error-rank{rank}.txt"
        assert error.is_file(), p.stderr[-4000:]
        assert error.read_text().startswith("NonFiniteGradientError: non-finite gradient at optimizer step 3"), rank
    assert sorted(c.name for c in stopped.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not list(stopped.glob("result-rank*.json"))

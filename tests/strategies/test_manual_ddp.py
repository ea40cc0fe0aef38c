"""Manual optimization on two processes (torchrun, gloo, CPU): DDP and FSDP2."""

from __future__ import annotations

import json

import pytest
import torch
from launching import SCRIPTS, run_each_ok

MANUAL_TARGET = SCRIPTS / "manual_target.py"
STRATEGIES = ["ddp", "fsdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the tests below, in three launches (each run as a launch of its own would do
    it, into its own folder; ``--then``): on 2 ranks, per strategy, the uninterrupted run, the run
    under no_sync accumulation and the run stopped after step 3; on one process both references
    (6 and 4 steps); then on 2 ranks both resumes of the stopped runs. What the stopped runs held
    before their resume (weights, checkpoint-3) is read in between: {name: value}."""
    base = tmp_path_factory.mktemp("manual")
    first = []
    for s in STRATEGIES:
        first += [(base / s / "ddp", ["--batch", "4", "--strategy", s]),
                  (base / s / "acc", ["--batch", "4", "--strategy", s, "--accumulate", "--steps", "4"]),
                  (base / s / "cut", ["--batch", "4", "--strategy", s, "--stop", "3"])]
    run_each_ok(2, first, script=MANUAL_TARGET)
    run_each_ok(1, [(base / "one", ["--batch", "8"]), (base / "one-4", ["--batch", "8", "--steps", "4"])],
                script=MANUAL_TARGET)
    got = {"base": base}
    for s in STRATEGIES:
        got[s, "halfway"] = torch.load(base / s / "cut" / "final-rank0.pt", weights_only=True)
        got[s, "checkpoint-3"] = (base / s / "cut" / "run" / "checkpoint-3").is_dir()
    run_each_ok(2, [(base / s / "cut", ["--batch", "4", "--strategy", s, "--resume"]) for s in STRATEGIES],
                script=MANUAL_TARGET)
    return got


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gan_on_two_ranks_equals_one_with_double_batch(runs, strategy):
    """Two backward passes per step, each over part of the module (D's, then G's with D frozen):
    no DDP reducer to hang, each optimizer's gradients averaged at ctx.step. 2 ranks x batch 4
    equal 1 process x batch 8 in float64 (to 1e-12): weights, both Adam states, logged losses;
    44 items: a short last batch at step 6. A 2-rank run stopped after step 3 and resumed ends
    with the uninterrupted 2-rank run's weights and optimizer states, bit for bit. FSDP2: G and D
    are shard units, their gradients reduce-scattered in each backward, both optimizers over
    sharded parameters, the checkpoint sharded (DCP); the weights compared, gathered."""
    base = runs["base"]
    ddp0, ddp1, one = (torch.load(base / d / f"final-rank{r}.pt", weights_only=True)
                       for d, r in ((f"{strategy}/ddp", 0), (f"{strategy}/ddp", 1), ("one", 0)))
    for k in one["weights"]:
        assert torch.equal(ddp0["weights"][k], ddp1["weights"][k]), "ranks disagree"
        torch.testing.assert_close(ddp0["weights"][k], one["weights"][k], rtol=1e-12, atol=1e-12, msg=k)
    assert not torch.equal(one["weights"]["D.0.weight"], _initial()["D.0.weight"])
    for a, b in zip(ddp0["optimizers"], one["optimizers"] if strategy == "ddp" else [], strict=True):
        for i, state in b["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(a["state"][i][key], value, rtol=1e-12, atol=1e-12)
    halfway = runs[strategy, "halfway"]  # the stopped run's, before its resume
    assert not torch.equal(halfway["weights"]["G.0.weight"], ddp0["weights"]["G.0.weight"])  # stopped early
    assert runs[strategy, "checkpoint-3"]
    resumed = torch.load(base / strategy / "cut" / "final-rank1.pt", weights_only=True)
    assert all(torch.equal(resumed["weights"][k], ddp0["weights"][k]) for k in ddp0["weights"])
    for a, b in zip(resumed["optimizers"], ddp0["optimizers"], strict=True):
        assert all(torch.equal(a["state"][i][key], v) for i, s in b["state"].items() for key, v in s.items())
    rows = [[json.loads(x) for x in (base / d / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
            for d in (f"{strategy}/ddp", "one")]
    for key in ("train/loss", "train/loss_d"):
        got, want = ([r[key] for r in rs if key in r] for rs in rows)
        assert len(want) == 6 and torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=0)


def _initial():
    import sys

    sys.path.insert(0, str(SCRIPTS.parent))
    from helpers import GAN

    torch.manual_seed(0)
    return GAN().double().state_dict()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulation_under_no_sync_equals_the_whole_batch(runs, strategy):
    """ctx.no_sync() around the first of two half-batch backward passes before one ctx.step, on
    2 ranks: the weights of 1 process stepping on the whole (double) batch, to 1e-12 in float64.
    Under FSDP the first backward skips its reduce-scatter and the second one does it."""
    acc, one = (torch.load(runs["base"] / d / "final-rank0.pt", weights_only=True)["weights"]
                for d in (f"{strategy}/acc", "one-4"))
    for k in one:
        torch.testing.assert_close(acc[k], one[k], rtol=1e-12, atol=1e-12, msg=k)

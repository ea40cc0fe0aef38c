"""Manual optimization under DDP (2 processes, gloo) where the ranks' training steps differ: a
rank that backpropagates through fewer parameters, or none, contributes zeros (as DDP's reducer
counts unused parameters); a rank that skips a ctx.step another takes is one error on every rank."""

from __future__ import annotations

import copy
import sys

import torch
from launching import SCRIPTS, launch, run_each_ok

TARGET = SCRIPTS / "manual_misuse_target.py"
#: step 2: rank 1 calls no ctx.backward; step 3: rank 1 uses expert a alone; step 4: both use a alone
PLAN = "2:1:none;3:1:a;4:0:a;4:1:a"


def _experts(plan):
    sys.path.insert(0, str(SCRIPTS))
    from manual_misuse_target import Experts, parse_plan

    torch.manual_seed(0)
    return Experts(parse_plan(plan)).double()


def _loss(model, what, batch, part=slice(None)):
    experts = what if what in ("a", "b") else "ab"
    out = sum((getattr(model, e)(batch["x"][part]) for e in experts), torch.zeros_like(batch["y"][part]))
    return ((out - batch["y"][part]) ** 2).mean()


def _by_hand(plan, seen):
    """The 2-rank steps written in plain PyTorch on one process: per step, each rank's gradient
    of its loss (None where it backpropagated nothing into a parameter), summed over the ranks
    with None as zeros and halved; a parameter no rank reached keeps no gradient (Adam skips it)."""
    model = _experts(plan)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), 0.1)
    for step in range(1, len(seen[0]) + 1):
        whats = [model.plan.get((step, rank), "ab") for rank in (0, 1)]
        for part in [slice(0, 2), slice(2, 4)] if whats[0] == "twice" else [slice(None)]:
            grads = []
            for rank in (0, 1):
                ref.zero_grad(set_to_none=True)
                if whats[rank] != "none":
                    _loss(ref, whats[rank], seen[rank][step - 1], part).backward()
                grads.append([p.grad for p in ref.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads, strict=True):
                given = [g for g in (g0, g1) if g is not None]
                p.grad = sum(given, torch.zeros_like(p)) / 2 if given else None
            opt.step()
    return ref, opt


def test_a_rank_without_gradients_contributes_zeros(tmp_path):
    """Step 2: rank 1 calls ctx.step without any ctx.backward; step 3: rank 1 backpropagates
    through expert a only; step 4: no rank reaches expert b. Before, gloo aborted rank 1 (a
    collective of another size) and rank 0 named no cause. Now both ranks end with the weights
    and Adam state of the hand-written reference to 1e-12 (float64); b's Adam state counts 3
    updates, not 4: a parameter no rank reached is skipped, as on one process."""
    run_each_ok(2, [(tmp_path, ["--plan", PLAN])], script=TARGET)
    ranks = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    ref, opt = _by_hand(PLAN, [r["seen"] for r in ranks])
    start = _experts(PLAN).state_dict()
    for k, want in ref.state_dict().items():
        assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k
        torch.testing.assert_close(ranks[0]["weights"][k], want, rtol=1e-12, atol=1e-12, msg=k)
        assert not torch.equal(want, start[k]), k
    got = ranks[0]["optimizer"]["state"]
    for i, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got[i][key], value, rtol=1e-12, atol=1e-12)
    assert [int(got[i]["step"]) for i in range(4)] == [4, 4, 3, 3]  # a.weight, a.bias, b.weight, b.bias


def test_two_updates_of_one_optimizer_in_a_step_are_each_averaged(tmp_path):
    """Two ctx.step of one optimizer in one training_step (each after a half batch's backward):
    before, the second update's gradients were not averaged over the ranks (the optimizer counted
    as prepared for the whole step) and the ranks' weights parted by 0.16. Now both ranks end
    with the hand-written reference's weights (each update's gradients averaged) to 1e-12."""
    plan = "2:0:twice;2:1:twice"
    run_each_ok(2, [(tmp_path, ["--plan", plan])], script=TARGET)
    ranks = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    ref, opt = _by_hand(plan, [r["seen"] for r in ranks])
    for k, want in ref.state_dict().items():
        assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k
        torch.testing.assert_close(ranks[0]["weights"][k], want, rtol=1e-12, atol=1e-12, msg=k)
    assert int(ranks[0]["optimizer"]["state"][0]["step"]) == 5 == int(opt.state_dict()["state"][0]["step"])


def test_a_rank_that_skips_ctx_step_is_one_error_on_every_rank(tmp_path):
    """Step 2: rank 1 calls ctx.backward but not ctx.step. Before, it died in gloo with no line of
    its own. Now every rank raises ModuleContractError naming the step, each rank and what it
    did, before any collective of another size."""
    p = launch(2, tmp_path, "--plan", "2:1:nostep", script=TARGET)
    assert p.returncode != 0
    text = p.stdout + p.stderr
    said = ("the ranks' training steps differ at step 2: rank 0 called ctx.step(ctx.optimizers[0]) (4 parameters) "
            "in training_step 2; rank 1 ended training_step 2 after 0 ctx.step call(s)")
    for rank in (0, 1):
        assert f"rank {rank} of 2 failed during train step at step 2: ModuleContractError: manual optimization " \
               f"under DDP: {said}" in text, text[-3000:]
    assert "EnforceNotMet" not in text and "SIGABRT" not in text


def test_a_raw_optimizer_step_is_an_error_under_ddp(tmp_path):
    """opt.step() on the raw optimizer under DDP's manual optimization would update each rank
    with its own gradients (averaged only by ctx.step): the ranks' weights would part without a
    word. It is an error before that update, naming the call to make instead."""
    p = launch(2, tmp_path, "--plan", "2:0:direct;2:1:direct", script=TARGET)
    assert p.returncode != 0
    text = p.stdout + p.stderr
    assert "failed during train step at step 2: ModuleContractError: ctx.optimizers[0].step() was called directly " \
           "in training_step 2: that bypasses ctx.step, so averaging the gradients over the ranks (each rank's " \
           "weights would differ), gradient clipping" in text, text[-3000:]
    assert "Call ctx.step(optimizer) instead" in text


def test_ranks_at_different_optimizers_are_one_error_naming_both(tmp_path):
    """Two optimizers; at step 2 rank 1 skips the first one's ctx.step and calls the second's:
    before, rank 0's all-reduce of optimizer 0's gradients met rank 1's of optimizer 1's (the
    same size: a's and b's gradients mixed) and the run hung at the next. Every rank raises
    instead, naming each rank's optimizer."""
    p = launch(2, tmp_path, "--two", "--plan", "2:1:skip0", script=TARGET)
    assert p.returncode != 0
    text = p.stdout + p.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 failed during train step at step 2: ModuleContractError: manual optimization " \
               "under DDP: the ranks' training steps differ at step 2: rank 0 called ctx.step(ctx.optimizers[0]) " \
               "(2 parameters) in training_step 2; rank 1 called ctx.step(ctx.optimizers[1]) (2 parameters) in " \
               "training_step 2." in text, text[-3000:]

"""DDP on real processes (torchrun, gloo, CPU) against one process: same weights, exact
evaluation on 1/2/3 processes, resume across world sizes, failing fast."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launching import DDP_TARGET, REF_8_STEPS, assert_close, free_port, launch, run_each_ok, weights
from launching import check_nan_gradient_on_one_rank as check_nan_gradient

DOUBLE_BATCH = [("plain", 1, "ddp"), ("plain", 2, "ddp"), ("token", 2, "ddp"), ("inttoken", 2, "ddp"),
                ("token", 2, "ddp:static-graph")]


def _double_batch_args(module, accum):
    return ["--task", module, "--accum", str(accum), "--steps", "7", "--items", "46", "--max-grad-norm", "0.5"]


@pytest.mark.parametrize("module,accum,strategy", DOUBLE_BATCH)
def test_two_processes_equal_one_with_double_batch(shared_run, module, accum, strategy):
    """2 ranks x batch 4 == 1 rank x batch 8, in float64 (to 1e-12), with accumulation and
    uneven item counts (token module: each item holds 1-4 'tokens'); 46 items: a short last batch.
    static_graph=True with accumulation: its reducer must see a synchronised backward first (torch
    asserted at step 1 when the first micro-step ran under no_sync)."""
    # every case's runs launched together, by the first case (one launch on 2 ranks, one on 1)
    case = DOUBLE_BATCH.index((module, accum, strategy))
    two_out = shared_run.each(2, *(["--batch", "4", "--strategy", st, *_double_batch_args(m, a)]
                                   for m, a, st in DOUBLE_BATCH))[case]
    one_out = shared_run.each(1, *(["--batch", "8", *_double_batch_args(m, a)] for m, a, _ in DOUBLE_BATCH))[case]
    ddp0, ddp1, one = weights(two_out, 0), weights(two_out, 1), weights(one_out)
    assert all(torch.equal(ddp0[k], ddp1[k]) for k in ddp0), "ranks disagree"
    assert_close(ddp0, one)
    # the logged training loss is the mean over all ranks' items: the same numbers
    logs = [[json.loads(x)["train/loss"] for x in (d / "logs" / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in x] for d in (two_out, one_out)]
    assert logs[0] == pytest.approx(logs[1], rel=1e-12)


def test_exact_evaluation_on_one_two_three_processes(tmp_path):
    results = {}
    for n in (1, 2, 3):
        proc = launch(n, tmp_path / str(n), "--mode", "eval", "--items", "23", "--batch", "4")
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[n] = json.loads((tmp_path / str(n) / "eval.json").read_text())
    for n in (2, 3):
        assert results[n]["predictions"] == results[1]["predictions"]
        assert results[n]["labels"] == results[1]["labels"]
        for k, v in results[1]["metrics"].items():
            assert results[n]["metrics"][k] == pytest.approx(v, rel=1e-12, abs=1e-14), k
    assert results[3]["metrics"]["val/n"] == 23.0  # no padding duplicates counted


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(shared_run, tmp_path, before, after):
    """Stop at step 4 on `before` processes, resume on `after` with the same global batch:
    the run continues on the right sample (positions are global)."""
    common = ["--steps", "8", "--items", "40", "--save-every", "4"]
    ref = shared_run(2, *REF_8_STEPS)
    out = tmp_path / "run"
    if before == 2:  # the reference is that run: its checkpoint-4, alone in a folder
        shutil.copytree(ref / "checkpoint-4", out / "checkpoint-4")
    else:
        p = launch(before, out, "--batch", str(8 // before), "--stop", "4", *common)
        assert p.returncode == 0, p.stderr[-3000:]
    p = launch(after, out, "--batch", str(8 // after), "--resume", *common)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "not a bit-exact continuation" in p.stderr or after == before
    assert_close(weights(out), weights(ref), tol=1e-10)


PER_RANK_BATCH = [(1, 2), (2, 1)]
PER_RANK_COMMON = ["--items", "40", "--batch", "4", "--save-every", "1", "--data", "recording"]


def _per_rank_batch_steps(before, after):
    first_steps = 3 if before == 1 else 2  # 12 or 16 of the 40 samples
    done = 4 * before * first_steps
    return first_steps, done, first_steps + -(-(40 - done) // (4 * after))  # to the end of the epoch


@pytest.fixture(scope="module")
def per_rank_batch(tmp_path_factory):
    """Both cases below in three launches (not four): the 1-process first run; on 2 ranks the
    other case's first run, then this case's resume; on 1 process that case's resume (each run
    records what it was served into its own folder: ``--then``). {(before, after): folder}."""
    base = tmp_path_factory.mktemp("per-rank-batch")
    outs = {case: base / f"{case[0]}-{case[1]}" for case in PER_RANK_BATCH}

    def first(case):
        return outs[case], ["--steps", str(_per_rank_batch_steps(*case)[0]), *PER_RANK_COMMON]

    def resume(case):
        return outs[case], ["--steps", str(_per_rank_batch_steps(*case)[2]), "--resume", *PER_RANK_COMMON]

    run_each_ok(1, [first((1, 2))])
    run_each_ok(2, [first((2, 1)), resume((1, 2))])
    run_each_ok(1, [resume((2, 1))])
    return outs


@pytest.mark.parametrize("before,after", PER_RANK_BATCH)
def test_resume_on_another_world_size_with_the_same_per_rank_batch(per_rank_batch, before, after):
    """The global batch changes with the world size (4 per rank): the resumed run takes exactly
    the samples the first run left in the epoch, each once, and its checkpoints record the
    true global position."""
    first_steps, done, steps = _per_rank_batch_steps(before, after)
    out = per_rank_batch[before, after]
    first = sum((json.loads((out / f"served-first-rank{r}.json").read_text()) for r in range(before)), [])
    rest = sum((json.loads((out / f"served-resumed-rank{r}.json").read_text()) for r in range(after)), [])
    assert len(first) == done
    assert sorted(first + rest) == list(range(40))
    for step in range(first_steps + 1, steps):
        state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["state"]
        assert (state["epoch_index"], state["samples_in_epoch"]) == (0, done + (step - first_steps) * 4 * after)
    state = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())["state"]
    assert (state["epoch_index"], state["samples_in_epoch"], state["samples_seen"]) == (1, 0, 40)


def test_uneven_iterable_shards_end_the_epoch_on_every_rank(tmp_path):
    """Rank 0's stream holds 5 items an epoch, rank 1's 3: both ranks end each epoch after 3
    steps (rank 0 skips its last 2 batches, with a warning) and evaluate together at its end."""
    p = launch(2, tmp_path / "run", "--data", "uneven-stream", "--batch", "1", "--steps", "7",
               "--eval-on-epoch-end", timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "another rank ran out of training data" in p.stderr
    w0, w1 = weights(tmp_path / "run", 0), weights(tmp_path / "run", 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks disagree"
    evals = [json.loads(x)["step"] for x in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
             if "val/loss" in x]
    assert evals == [3, 6, 7]  # two epoch ends, then the final evaluation


def test_uneven_iterable_shards_resume_mid_epoch_bit_identical(tmp_path):
    """Rank 0's stream holds 5 items, rank 1's 3; accumulating 2. At step 2 rank 1's window holds
    its last batch: the epoch ends there on both ranks (read one batch ahead), before
    checkpoint-2, so a resume from it starts the next epoch (rank 0's last batch left out, with a
    warning). From checkpoint-1, mid-epoch, each rank reads its own 2 batches again. Both resumes
    end with the uninterrupted run's weights on every rank (each resumes a copy of the run's
    checkpoint, alone in a folder)."""
    common = ["--data", "uneven-stream", "--batch", "1", "--accum", "2", "--steps", "5", "--save-every", "1"]
    assert launch(2, tmp_path / "ref", *common).returncode == 0
    for stop, replayed in ((2, None), (1, "reading the 2 batch(es)")):
        out = tmp_path / f"stop{stop}"
        shutil.copytree(tmp_path / "ref" / f"checkpoint-{stop}", out / f"checkpoint-{stop}")
        resumed = launch(2, out, *common, "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        if replayed is None:
            assert "reading the" not in resumed.stderr
        else:
            assert resumed.stderr.count(replayed) == 2, resumed.stderr[-3000:]
        for rank in (0, 1):
            a, b = weights(out, rank), weights(tmp_path / "ref", rank)
            assert all(torch.equal(a[k], b[k]) for k in a), f"stop {stop}: rank {rank} differs"


@pytest.mark.parametrize("budget, accum, steps", [(["--steps", "3"], "1", 3), (["--epochs", "2"], "1", 2),
                                                  (["--epochs", "2"], "2", 6)])
def test_a_user_sampler_with_uneven_shares_does_not_hang(tmp_path, budget, accum, steps):
    """A DataLoader with ResumableSampler(n, rank, world_size=2) (not even): rank 0 holds one item
    more. 9 items, batch 4 (accumulation 1): rank 0 has batches of 4 and 1, rank 1 one of 4; 21
    items, batch 2, accumulation 2: 6 and 5 batches. An epoch is as long as the shorter share
    and ends on both ranks when rank 1 runs out (rank 0 skips what is left, with a warning). Rank
    0 waited for ever, or, with max_epochs, the ranks counted different steps (one hung) or one
    rank ended its epoch a window early (an empty epoch, DataError), or the last epoch never
    ended (no epoch end, evaluation or save of it; a resume then found a mid-epoch position)."""
    items, batch = ("9", "4") if accum == "1" else ("21", "2")
    p = launch(2, tmp_path, "--data", "user-uneven-sampler", "--items", items, "--batch", batch, "--accum", accum,
               "--save-every", str(steps), *budget, timeout=90)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "its last 1 are left out" in p.stderr or accum == "2"  # rank 0's short batch
    w0, w1 = weights(tmp_path, 0), weights(tmp_path, 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks disagree"
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert max(json.loads(x)["step"] for x in lines) == steps
    if budget[0] == "--epochs":  # the last epoch ended, as on one process
        state = json.loads((tmp_path / f"checkpoint-{steps}" / "trainer_state.json").read_text())["state"]
        assert (state["epoch_index"], state["samples_in_epoch"], state["epoch"]) == (2, 0, 2.0)


def test_a_users_shuffled_loader_checkpointed_mid_epoch_on_one_process_resumes_on_two(tmp_path):
    """One process with a DataLoader of the user's (torch's RandomSampler), resumed mid-epoch on
    two: on both it is rebuilt with lightlike's sampler, whose order is a function of (seed,
    epoch) and whose position counts global samples, so the rest of the epoch (32 of 40 samples,
    4 steps of 2 x 4) ends the epoch exactly at step 6 (it was refused: torch's RandomSampler
    could not seek)."""
    common = ["--data", "user-shuffled", "--batch", "4", "--steps", "6", "--save-every", "2", "--items", "40"]
    assert launch(1, tmp_path, *common, "--stop", "2").returncode == 0
    resumed = launch(2, tmp_path, *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())["state"]
    assert (state["epoch_index"], state["samples_in_epoch"]) == (1, 0)
    four = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["state"]
    assert (four["epoch_index"], four["samples_in_epoch"]) == (0, 24)  # 8 + 2 steps x 8


def test_failures_outside_the_training_loop_end_every_rank(tmp_path):
    """An output_dir that holds a run (checked on rank 0 only) and an error in validate() on
    rank 1: every rank exits quickly, and the message says what to change / who failed."""
    out = tmp_path / "run"
    assert launch(2, out, "--steps", "2", "--save-every", "2").returncode == 0
    start = time.monotonic()
    p = launch(2, out, "--steps", "2", "--save-every", "2", "--no-overwrite", timeout=120)
    assert p.returncode != 0
    assert p.stderr.count("already holds a run") >= 2, p.stderr[-3000:]  # raised on both ranks
    assert time.monotonic() - start < 60  # generous bounds on a hang, not speed claims
    start = time.monotonic()
    p = launch(2, tmp_path / "eval", "--mode", "fail-eval", "--items", "9", timeout=120)
    elapsed = time.monotonic() - start
    assert p.returncode != 0
    assert "rank 1 of 2 failed during evaluation" in p.stderr, p.stderr[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f}s"


def test_failure_on_one_rank_ends_all_quickly(tmp_path):
    start = time.monotonic()
    p = launch(2, tmp_path / "fail", "--mode", "fail", "--fail-rank", "1", "--fail-step", "3", "--steps", "50",
               timeout=120)
    elapsed = time.monotonic() - start
    assert p.returncode != 0
    assert "rank 1 of 2 failed during step end at step 3: RuntimeError: injected failure on rank 1" in p.stderr
    assert "rank 0 of 2 failed" not in p.stderr  # rank 0's collective lost its peer: "stopped", if it says anything
    if "rank 0 of 2 stopped" in p.stderr:  # (torchrun may end it first) it names the rank that failed, and why
        assert re.search(r"rank 0 of 2 stopped during [a-z ]+ at step \d+: rank 1 of 2 failed during step end at "
                         r"step 3: RuntimeError: injected failure on rank 1 \(here: ", p.stderr), p.stderr[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f}s"  # a generous bound on a hang, not a speed claim


def test_on_save_runs_on_every_rank_and_a_data_error_names_the_train_step(tmp_path):
    """A stop set in on_save (the same on every rank, as the docs ask) ends every rank at that
    step: on_save ran on rank 0 only, so rank 1 trained on and the job hung or aborted. And a
    batch that fails to load is blamed on the train step, not on the save before it."""
    p = launch(2, tmp_path / "stop", "--mode", "stop-on-save", "--steps", "10", "--save-every", "2", timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [(tmp_path / "stop" / f"on_save-rank{r}.txt").read_text() for r in (0, 1)] == ["2 checkpoint-2"] * 2
    assert sorted(x.name for x in (tmp_path / "stop").glob("checkpoint-*")) == ["checkpoint-2"]
    start = time.monotonic()
    p = launch(2, tmp_path / "data", "--mode", "fail-data", "--fail-step", "3", "--save-every", "3", "--steps", "9",
               timeout=120)
    assert p.returncode != 0
    assert "rank 1 of 2 failed during train step at step 4: ValueError: corrupt record on rank 1" in p.stderr, \
        p.stderr[-3000:]
    assert time.monotonic() - start < 60  # a generous bound on a hang, not a speed claim


def test_out_of_memory_on_one_rank_fails_fast_under_auto_find_batch_size(tmp_path):
    """auto_find_batch_size retried on the rank that ran out of memory alone, starting a new fit's
    collectives against a peer still in the old step's all-reduce: every rank hung until the
    process group's timeout (600 s)."""
    start = time.monotonic()
    p = launch(2, tmp_path / "oom", "--mode", "oom", "--steps", "20", timeout=120)
    assert p.returncode != 0
    assert "auto_find_batch_size retries on one process only" in p.stderr, p.stderr[-3000:]
    assert "rank 1 of 2 failed during train step at step 3: RuntimeError: DefaultCPUAllocator" in p.stderr
    assert time.monotonic() - start < 60  # a generous bound on a hang, not a speed claim


def test_fewer_items_than_processes_says_so(tmp_path):
    """1 item on 2 processes: the even split leaves every item out. The error blamed drop_last and
    the batch size (neither set, neither the cause)."""
    p = launch(2, tmp_path / "one", "--items", "1", "--batch", "4", "--steps", "2", timeout=120)
    assert p.returncode != 0
    assert "the training data has 1 item(s) for 2 processes" in p.stderr, p.stderr[-3000:]


def test_uneven_data_does_not_hang(tmp_path):
    """41 items on 2 ranks, batch 4: without care rank 0 would take a 6th batch per epoch while
    rank 1 waits in a collective. The odd item of each epoch's order is left out, with a warning."""
    p = launch(2, tmp_path / "uneven", "--items", "41", "--batch", "4", "--steps", "14", timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "41 training items do not split evenly over 2 processes" in p.stderr, p.stderr[-3000:]
    w0, w1 = weights(tmp_path / "uneven", 0), weights(tmp_path / "uneven", 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks disagree"


KILL_COMMON = ["--steps", "9", "--items", "40", "--batch", "4", "--accum", "2", "--save-every", "2", "--task", "token",
               "--log-every", "4"]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A run killed after step 3 and one after step 6 (a launch each: the kill ends it), then both
    resumes and the uninterrupted reference in one launch (``--then``). {kill step: (resumed
    folder, reference folder, killed run's return code)}."""
    base = tmp_path_factory.mktemp("kills")
    ref = base / "ref"
    killed = {step: launch(2, base / str(step), *KILL_COMMON, "--kill-step", str(step)).returncode for step in (3, 6)}
    run_each_ok(2, [*((base / str(step), [*KILL_COMMON, "--resume"]) for step in (3, 6)), (ref, KILL_COMMON)])
    return {step: (base / str(step), ref, killed[step]) for step in (3, 6)}


@pytest.mark.parametrize("kill_step", [3, 6])
def test_kill_one_rank_and_resume_is_bit_identical(killed_and_resumed, kill_step):
    """SIGKILL rank 1 mid-run (after step 3: mid-epoch; after 6: past an epoch boundary), let
    torchrun end rank 0, resume on 2 processes: the same weights, bit for bit, as without the kill,
    and the same logs: a log every 4 steps, so each checkpoint holds losses not yet logged, every
    rank's (only rank 0's were kept, so the resumed run logged a wrong mean)."""
    out, ref, killed = killed_and_resumed[kill_step]
    assert killed != 0
    for rank in (0, 1):
        a, b = weights(out, rank), weights(ref, rank)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank} differs"
    logs = [(d / "logs" / "metrics.jsonl").read_text() for d in (out, ref)]
    assert logs[0] == logs[1]


def test_every_rank_resumes_from_the_checkpoint_the_main_rank_chose(shared_run, tmp_path):
    """resume=True: rank 1's checksum pass over checkpoint-6 fails (an I/O error). The choice
    is made once, on rank 0, for every rank: both resume from checkpoint-6 and end with the
    uninterrupted run's weights. Each rank chose for itself before: rank 1 fell back to
    checkpoint-4, the ranks trained two steps apart in the same all-reduces, and rank 1 hung."""
    common = REF_8_STEPS
    ref = shared_run(2, *common)
    out = tmp_path / "run"
    for step in (2, 4, 6):  # what the run stopped after step 6 holds
        shutil.copytree(ref / f"checkpoint-{step}", out / f"checkpoint-{step}")
    resumed = launch(2, out, *common, "--resume", "--unreadable-on-rank1", "checkpoint-6", timeout=90)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        a, b = weights(out, rank), weights(ref, rank)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank} differs"


def test_preemption_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM reaches rank 1 only, after step 3. The ranks vote every 10 steps without waiting
    for the vote (started at step 10, read at step 20): both save checkpoint-20 and exit 75, and
    resuming on 2 processes ends with the uninterrupted run's weights, bit for bit."""
    from lightlike.checkpoint import list_checkpoints, verify_checkpoint

    common = ["--steps", "30", "--items", "48", "--batch", "4"]
    out = tmp_path / "run"
    p = launch(2, out, *common, "--signal-step", "3", "--fail-rank", "1", timeout=120)
    assert p.returncode != 0
    assert "SIGTERM received: saving a checkpoint at step 20" in p.stderr, p.stderr[-3000:]
    assert "a signal on another rank received: saving a checkpoint at step 20" in p.stderr, p.stderr[-3000:]
    # torchrun's summary: the first rank to exit reports 75; torchrun may SIGTERM the other
    # before it reports its own 75 (both ranks have committed the checkpoint by then)
    codes = re.findall(r"exitcode  : (-?\d+)", p.stderr)
    assert "75" in codes and set(codes) <= {"75", "-15"}, p.stderr[-3000:]
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-20"]
    verify_checkpoint(out / "checkpoint-20")
    run_each_ok(2, [(out, [*common, "--resume"]), (tmp_path / "ref", common)])  # the resume, then the reference
    for rank in (0, 1):
        a, b = weights(out, rank), weights(tmp_path / "ref", rank)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank} differs"


STREAMS = Path(__file__).parents[1] / "scripts" / "rank_streams_target.py"


def test_each_rank_resumes_its_own_random_streams(tmp_path):
    """Ranks drawing different amounts from torch, numpy and Python's generators (other tests'
    ranks all draw alike, so restoring rank 0's states everywhere passed them): killed after step
    5 (checkpoint-4), resumed, each rank ends with the uninterrupted run's weights, bit for bit."""
    assert launch(2, tmp_path / "ref", "rng", script=STREAMS).returncode == 0
    assert launch(2, tmp_path / "cut", "rng", "--stop", "5", script=STREAMS).returncode != 0
    p = launch(2, tmp_path / "cut", "rng", script=STREAMS)
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        ref, got = weights(tmp_path / "ref", rank), weights(tmp_path / "cut", rank)
        assert all(torch.equal(ref[k], got[k]) for k in ref), rank


def test_a_nonfinite_loss_on_one_rank_is_skipped_or_raised_on_every_rank(tmp_path):
    """NaN on rank 1 only: with 'skip' every rank skips the step (rank 0 alone would apply
    rank 1's NaN gradient after the all-reduce: NaN weights on both); with 'raise' every rank fails."""
    p = launch(2, tmp_path / "skip", "nan", "skip", script=STREAMS)
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / "skip" / f"result-rank{rank}.json").read_text())["skipped"] == 1
        assert all(torch.isfinite(v).all() for v in weights(tmp_path / "skip", rank).values())
    assert_close(weights(tmp_path / "skip", 0), weights(tmp_path / "skip", 1), tol=0)
    p = launch(2, tmp_path / "raise", "nan", "raise", script=STREAMS)
    assert p.returncode != 0 and "non-finite" in p.stderr.lower(), p.stderr[-3000:]
    assert not list((tmp_path / "raise").glob("result-rank*.json"))


def test_a_nan_gradient_on_one_rank_is_skipped_or_raised_on_every_rank(tmp_path):
    """A finite loss whose gradient is NaN on rank 1 only: DDP's all-reduce makes every rank's
    gradient NaN, and the optimizer stepped with it on both (NaN weights in checkpoint-3 and after,
    'skip' returned as a success). Now both ranks skip it, or both raise naming step 3."""
    check_nan_gradient(tmp_path, "ddp")


def test_preemption_with_token_counts_stops_every_rank_at_the_vote_and_requeues_once(tmp_path):
    """With per-item counts (an item-count all-reduce every step) the ranks agree on a stop by the
    same 10-step vote as with equal shares: SIGTERM on rank 1 after step 3 stops both ranks at step
    20 (vote started at 10, read at 20), though step 20 logs nothing (log_every=100). Under SLURM
    the job is requeued once, by rank 0 (on every rank passed the single-process requeue tests)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    (bin_dir / "scontrol").chmod(0o755)
    out = tmp_path / "run"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(DDP_TARGET), str(out), "--task", "token", "--steps", "30", "--items", "48",
           "--batch", "4", "--signal-step", "3", "--fail-rank", "1", "--log-every", "100"]
    env = {**os.environ, "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode != 0
    assert "SIGTERM received: saving a checkpoint at step 20" in p.stderr, p.stderr[-3000:]
    assert sorted(c.name for c in out.glob("checkpoint-*")) == ["checkpoint-20"]
    assert record.read_text().splitlines() == ["requeue 4242"]

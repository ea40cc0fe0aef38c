"""Kill anywhere, resume, and finish with exactly the uninterrupted run's weights and logs.

Real processes are SIGKILLed at seeded-random points: mid-step, mid-accumulation window, during
evaluation, during a checkpoint write, right after a step, and at random wall-clock moments.
The resumed run must end with bit-identical weights and an identical metrics log (every step
once). ``pytest --extended`` runs more cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lightlike.checkpoint import list_checkpoints, verify_checkpoint
from lightlike.preemption import EXIT_PREEMPTED

SCRIPT = Path(__file__).parents[1] / "scripts" / "kill_target.py"
CONFIGS = [("32-true", 0), ("bf16-mixed", 0), ("32-true", 2), ("bf16-mixed", 2)]
# every kill point must fire (a case whose kill never happens tests nothing). A run from the start
# makes 21 training forwards, 8 evaluation forwards, 6 saves of 9 files each and 12 steps:
RANGES = {"micro": (1, 21), "eval": (1, 8), "save": (1, 6), "step": (1, 12)}
# a second kill hits the resumed run, which has at least steps 11-12 (3 forwards), step 12's
# evaluation (2 forwards) and its save left to do: the newest checkpoint a killed run leaves is 10
AGAIN = {"micro": (1, 3), "eval": (1, 2), "save": (1, 1), "step": (11, 12)}
FILES_PER_SAVE = 9


def run(out, precision, workers, kill="", async_save=False, start_method=None, manual=False):
    """Run the script to its end (or its kill) and return its exit code and output.

    Waits for the script's own process only, then kills what it left: a DataLoader worker forked
    just before its parent was SIGKILLed can outlive it for good (torch's worker watchdog reads
    ``getppid()`` when the worker starts; if the parent is already dead that is 1, which never
    changes). Such an orphan kept ``capture_output``'s pipes open and hung a CI run for 300 s.
    lightlike's loaders now end such workers (``lightlike/data/workers.py``, tested in
    ``test_workers.py``); this harness checks the script, not its grandchildren."""
    cmd = [sys.executable, str(SCRIPT), str(out), "--precision", precision, "--workers", str(workers)]
    if kill:
        cmd += ["--kill", kill]
    if async_save:
        cmd += ["--async-save"]
    if start_method:
        cmd += ["--start-method", start_method]
    if manual:
        cmd += ["--manual"]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # orphaned workers, if any
            proc.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(cmd, returncode, stdout.read(), stderr.read())


def outcome(out):
    metrics = [json.loads(line) for line in (Path(out) / "logs" / "metrics.jsonl").read_text().splitlines()]
    return (Path(out) / "final.safetensors").read_bytes(), metrics


_REFERENCE: dict = {}


def reference(tmp_path_factory, precision, workers):
    key = (precision, workers)
    if key not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"ref-{precision}-{workers}")
        proc = run(out, precision, workers)
        assert proc.returncode == 0, proc.stderr
        _REFERENCE[key] = outcome(out)
    return _REFERENCE[key]


def kill_point(rng, ranges=RANGES):
    kind = rng.choice(sorted(ranges))
    lo, hi = ranges[kind]
    n = rng.randint(lo, hi)
    return f"save:{n}:{rng.randint(0, FILES_PER_SAVE - 1)}" if kind == "save" else f"{kind}:{n}"


def cases(extended):
    rng = random.Random(20261122)
    out = []
    for i in range(48 if extended else 12):
        precision, workers = CONFIGS[i % len(CONFIGS)]
        kills = [kill_point(rng)]
        if rng.random() < 0.3:
            kills.append(kill_point(rng, AGAIN))  # killed again while resuming
        out.append((precision, workers, kills, i % 3 == 2))  # every third: background commits
    return out


def pytest_generate_tests(metafunc):
    if "kill_case" in metafunc.fixturenames:
        extended = metafunc.config.getoption("--extended")
        all_cases = cases(extended)
        metafunc.parametrize("kill_case", all_cases, ids=[f"{p}-w{w}-{'+'.join(k)}{'-async' if a else ''}" for p, w, k, a in all_cases])


def test_kill_anywhere_resume_is_bit_identical(tmp_path, tmp_path_factory, kill_case):
    """With background commits (async_save) too: the same weights and logs as the synchronous,
    uninterrupted reference run."""
    precision, workers, kills, async_save = kill_case
    out = tmp_path / "run"
    for kill in kills:
        proc = run(out, precision, workers, kill, async_save)
        assert proc.returncode == -signal.SIGKILL, f"the kill at {kill} never fired: {proc.stderr}"
        assert f"kill fired: {kill}" in proc.stdout
        for ckpt in list_checkpoints(out):
            verify_checkpoint(ckpt)  # whatever is visible is complete
    proc = run(out, precision, workers, async_save=async_save)
    assert proc.returncode == 0, proc.stderr
    weights, metrics = outcome(out)
    ref_weights, ref_metrics = reference(tmp_path_factory, precision, workers)
    assert metrics == ref_metrics
    assert weights == ref_weights


@pytest.mark.parametrize("kills", [["micro:9"], ["step:7"], ["save:3:4", "micro:2"], ["eval:3"]])
def test_kill_anywhere_resume_is_bit_identical_with_manual_optimization(tmp_path, kills):
    """A module with training_step (two optimizers, one with a scheduler, two backward passes a
    step): killed between a step's two forwards (micro:9 is step 5's first), after a step, during
    a save (then again while resuming), during evaluation; the resumed run ends with the
    uninterrupted run's weights and logs (every optimizer's and scheduler's state restored)."""
    ref = tmp_path / "ref"
    proc = run(ref, "32-true", 0, manual=True)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "run"
    for kill in kills:
        proc = run(out, "32-true", 0, kill, manual=True)
        assert proc.returncode == -signal.SIGKILL, f"the kill at {kill} never fired: {proc.stderr}"
        assert f"kill fired: {kill}" in proc.stdout
    proc = run(out, "32-true", 0, manual=True)
    assert proc.returncode == 0, proc.stderr
    weights, metrics = outcome(out)
    ref_weights, ref_metrics = outcome(ref)
    assert any("train/loss_again" in row for row in ref_metrics)
    assert metrics == ref_metrics
    assert weights == ref_weights


def test_preemption_saves_exits_and_resumes_with_manual_optimization(tmp_path):
    """SIGTERM after step 5 of a manual module's fit: saved at step 5, exit 75; the resumed run
    ends with the uninterrupted run's weights and logs."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert run(ref, "32-true", 0, manual=True).returncode == 0
    proc = run(out, "32-true", 0, "term:5", manual=True)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-5"
    proc = run(out, "32-true", 0, manual=True)
    assert proc.returncode == 0, proc.stderr
    assert outcome(out) == outcome(ref)


def newest_step(out):
    return max((int(p.name.split("-")[1]) for p in list_checkpoints(out)), default=0) if out.is_dir() else 0


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_at_random_wall_clock_moments(tmp_path, tmp_path_factory, seed):
    """SIGKILL from outside, twice, at a random moment after the run's first checkpoint of its own
    (timed from the process start, the kills often fell before any checkpoint or after the run had
    ended: nothing was resumed). Steps take 0.15 s longer, so the kill lands within 3 steps."""
    rng = random.Random(seed)
    out = tmp_path / "run"
    for _ in range(2):
        before = newest_step(out)
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--step-sleep", "0.15"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while newest_step(out) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.45 * rng.random())
        assert proc.poll() is None, "the run ended before it was killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert before < newest_step(out) < 12  # it saved something, and was killed before its end
    proc = run(out, "32-true", 0)
    assert proc.returncode == 0, proc.stderr
    assert outcome(out) == reference(tmp_path_factory, "32-true", 0)


@pytest.mark.parametrize("sig", ["term", "usr1", "term2"])
def test_preemption_signal_saves_exits_and_resumes(tmp_path, tmp_path_factory, sig):
    out = tmp_path / "run"
    proc = run(out, "32-true", 0, f"{sig}:5")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    assert "saving a checkpoint at step 5" in proc.stderr
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-5"
    verify_checkpoint(out / "checkpoint-5")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    proc = run(out, "32-true", 0)
    assert proc.returncode == 0, proc.stderr
    assert outcome(out) == reference(tmp_path_factory, "32-true", 0)


@pytest.mark.parametrize("workers,start_method", [(0, None), (2, None), (2, "forkserver")])
def test_preemption_signal_to_the_process_group_reaches_workers_harmlessly(tmp_path, tmp_path_factory, workers,
                                                                           start_method):
    """torchrun forwards its SIGTERM to the process group and SLURM signals the job step: the
    DataLoader workers got it too, torch's handler ended them, and the run failed ('DataLoader
    worker ... is killed by signal: Terminated', exit 1) instead of saving and exiting 75. Under
    forkserver (Python 3.14's default) the signal ended the fork server, and its workers with it."""
    out = tmp_path / "run"
    proc = run(out, "32-true", workers, "termgroup:5", start_method=start_method)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-5"
    proc = run(out, "32-true", workers)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outcome(out) == reference(tmp_path_factory, "32-true", workers)


def test_preemption_signal_while_workers_start_reaches_them_harmlessly(tmp_path, tmp_path_factory):
    """The signal lands while the evaluation after step 6 starts its workers, before they can
    ignore it (torch's handler is installed first): it ended them. Workers start with the signal
    blocked, so it waits for them to ignore it; the run saves and exits 75."""
    out = tmp_path / "run"
    proc = run(out, "32-true", 2, "termgroupstart:6")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-6"
    assert run(out, "32-true", 2).returncode == 0
    assert outcome(out) == reference(tmp_path_factory, "32-true", 2)


def test_preemption_signal_during_set_up_is_acted_on_at_the_first_step(tmp_path, tmp_path_factory):
    """A signal while a resume loads its checkpoint (set-up can take minutes on a large run:
    verification, a distributed load, DeepSpeed's conversion) took its default action: the job
    died (exit -15), unrequeued. The handler is installed before set-up, so the flag waits for the
    first step boundary: saved there, exit 75, and the run resumes to the uninterrupted result."""
    out = tmp_path / "run"
    assert run(out, "32-true", 0, "term:4").returncode == EXIT_PREEMPTED
    proc = run(out, "32-true", 0, "termload")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "saving a checkpoint at step 5" in proc.stderr
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-5"
    assert run(out, "32-true", 0).returncode == 0
    assert outcome(out) == reference(tmp_path_factory, "32-true", 0)


def test_preemption_mid_window_saves_at_the_step_boundary(tmp_path, tmp_path_factory):
    """A checkpoint requested mid-accumulation is taken when the window's step completes: micro-
    batch 8 is the first of step 5's two-batch window, so the checkpoint is checkpoint-5."""
    out = tmp_path / "run"
    proc = run(out, "32-true", 0, "termmicro:8")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-5"
    assert run(out, "32-true", 0).returncode == 0
    assert outcome(out) == reference(tmp_path_factory, "32-true", 0)


def slurm_with_scontrol_stub(tmp_path):
    """An environment under SLURM whose `scontrol` (on PATH) records its arguments in a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.log"
    stub = bin_dir / "scontrol"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\n")
    stub.chmod(0o755)
    return {**os.environ, "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"}, record


def test_preemption_requeues_under_slurm(tmp_path):
    """With SLURM_JOB_ID set, the Fitter calls `scontrol requeue <id>` (a stub on PATH here)."""
    env, record = slurm_with_scontrol_stub(tmp_path)
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "run"), "--kill", "term:3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    assert record.read_text().split() == ["requeue", "4242"]
    # and without scontrol on PATH it still saves and exits cleanly
    env["PATH"] = os.path.dirname(sys.executable)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run2"), "--kill", "term:3"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == EXIT_PREEMPTED and "scontrol is not on PATH" in proc.stderr


def test_preemption_without_requeue_saves_and_exits_but_leaves_the_job_alone(tmp_path):
    """requeue_on_preemption=False under SLURM: checkpoint and exit 75, but no `scontrol requeue`."""
    env, record = slurm_with_scontrol_stub(tmp_path)
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "run"), "--kill", "term:3", "--no-requeue"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    assert [p.name for p in list_checkpoints(tmp_path / "run")][-1] == "checkpoint-3"
    assert not record.exists()


def test_a_signal_at_the_last_step_ends_the_run_normally(tmp_path, tmp_path_factory):
    """A run that ends at this step anyway (max_steps) is not preempted by a signal received
    there: it exited 75 and requeued on one process (while several processes ended normally),
    and with a stop set by a callback the requeued job trained on past it."""
    env, record = slurm_with_scontrol_stub(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "run"), "--kill", "term:12"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "SIGTERM received at the run's last step 12: it ends normally" in proc.stderr
    assert not record.exists()  # no requeue
    assert outcome(tmp_path / "run") == reference(tmp_path_factory, "32-true", 0)

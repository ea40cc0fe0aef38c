"""The preemption vote and its edges (audit AO's mutation round): the every-10-steps vote on
several processes with equal shares (started at step 10k, read at 10k+10, waited for once), the
SLURM requeue's outcomes with a real `scontrol` stub, signal names, and stale-temp cleanup that
must keep the temp folder of a process it may not signal (PermissionError: alive)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset, run_killing_group

import lightlike as ll
from lightlike.preemption import EXIT_PREEMPTED, Preempted, PreemptionHandler, requeue_slurm_job

SCRIPTS = Path(__file__).parents[1] / "scripts"


class TwoRanks:
    """A stand-in for a two-process strategy and its collectives (itself): ``reduce_flag_async``
    ORs this rank's flag with the peer's (``peer``) and records when each vote is started and read."""

    world_size = 2

    def __init__(self, peer=False):
        self.peer, self.started, self.read = peer, [], []
        self.collectives = self

    def reduce_flag_async(self, flag):
        n = len(self.started)
        self.started.append(bool(flag))
        value = bool(flag) or self.peer

        def read():
            self.read.append(n)
            return value
        return read


def run_votes(handler, strategy, steps, signal_after=None):
    """stop_requested at each step boundary 1..steps; the first
    step at which it says stop, or None. A real SIGUSR1 arrives after step ``signal_after``."""
    for step in range(1, steps + 1):
        if step - 1 == signal_after:
            os.kill(os.getpid(), signal.SIGUSR1)
        if handler.stop_requested(strategy, step):
            return step
    return None


@pytest.fixture
def handler():
    h = PreemptionHandler(["SIGUSR1"])
    h.install()
    yield h
    h.uninstall()


@pytest.mark.parametrize("signal_after", [3, 9, 10, 13])
def test_the_vote_starts_every_10_steps_and_is_read_at_the_next(handler, signal_after):
    """A signal after step 3 or 9 is in the vote started at step 10 and read at step 20; one after
    step 10 or 13 misses it, is in step 20's vote and stops at step 30. Each vote is read once,
    at the next vote (never waited for at its own step)."""
    strategy = TwoRanks()
    stop = run_votes(handler, strategy, 40, signal_after)
    assert stop == (20 if signal_after < 10 else 30)
    assert strategy.started == ([False, True] if signal_after >= 10 else [True]) + [True]
    assert strategy.read == list(range(len(strategy.started) - 1))
    assert handler.vote is not None  # the last vote is still in flight


def test_no_signal_anywhere_never_stops_and_a_peers_signal_stops_at_the_same_step(handler):
    assert run_votes(handler, TwoRanks(), 45) is None
    strategy = TwoRanks(peer=True)  # the signal reached the other rank only
    assert run_votes(handler, strategy, 45) == 20 and handler.signal_name == ""
    assert strategy.started == [False, False]


def test_finish_vote_waits_for_the_vote_in_flight_once_and_drops_it(handler):
    strategy = TwoRanks(peer=True)
    assert run_votes(handler, strategy, 25) == 20
    assert strategy.read == [0]
    handler.finish_vote()
    assert strategy.read == [0, 1] and handler.vote is None
    handler.finish_vote()  # nothing in flight: nothing waited for again
    assert strategy.read == [0, 1]


def test_one_process_stops_at_the_signal_and_several_vote_every_ten_steps(handler):
    """One process: ``stop_requested`` is the signal, at any step. Several: a vote is started at
    every VOTE_EVERY-th step and at no other (no collective on the other steps)."""
    one = TwoRanks()
    one.world_size = 1
    assert not handler.stop_requested(one, 7)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.stop_requested(one, 7)
    strategy = TwoRanks(peer=True)
    for step in range(1, 41):
        started = len(strategy.started)
        handler.stop_requested(strategy, step)
        assert (len(strategy.started) > started) == (step % 10 == 0), step


def test_every_vote_a_rank_starts_is_waited_for_before_fit_ends_or_exits(tmp_path):
    """Two real processes with equal shares (the 10-step vote): a fit that ends normally after 25
    steps (votes at 10 and 20), then one that SIGUSR1 on rank 1 after step 3 preempts at step 20
    (exit code 75): on every rank every started vote was read before fit() returned or raised."""
    from launching import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(SCRIPTS / "ao_vote_target.py"), str(tmp_path)]
    p = run_killing_group(cmd, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"votes-rank{rank}.json").read_text())
        assert got["normal"] == {"step": 25, "started": 2, "read": 2}, (rank, got)
        assert got["preempted"] == {"step": 20, "started": 2, "read": 2, "code": 75}, (rank, got)


def test_the_exit_code_is_75():
    """sysexits' EX_TEMPFAIL, what SLURM requeue recipes and the docs expect (not just a constant
    the tests import from the same module)."""
    assert EXIT_PREEMPTED == 75
    e = Preempted("SIGTERM", "out/checkpoint-3")
    assert e.code == 75 and "exit code 75" in str(e)


def test_signal_names_without_the_sig_prefix_and_in_any_case():
    assert PreemptionHandler(["term", "Usr1", "SIGUSR2", "sigint"]).signals == [
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT]
    for bad in ([b"SIGTERM"], [15], ["SIGNOPE"]):  # never a raw TypeError/AttributeError
        with pytest.raises(ll.ConfigError, match="preemption_signals: unknown signal"):
            PreemptionHandler(bad)


def test_a_short_signal_name_preempts_a_real_fit(tmp_path):
    class SignalAt2(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)

    fitter = ll.Fitter(max_steps=6, batch_size=8, preemption_signals=["usr1"], requeue_on_preemption=False,
                       output_dir=str(tmp_path), loggers=[], callbacks=[SignalAt2()])
    with pytest.raises(Preempted) as e:
        fitter.fit(Classifier(), DictDataset(n=48))
    assert e.value.signal_name == "SIGUSR1" and e.value.code == 75 and fitter.state.global_step == 2


def test_an_out_of_memory_retry_restores_the_signal_handlers_after_the_fit(tmp_path):
    """The retry re-enters the set-up that installs the handlers; installing twice recorded the
    fit's own handler as the one to restore, and it stayed after fit() (every later SIGTERM
    swallowed)."""
    class OOMAbove4(Classifier):
        def forward(self, batch):
            if len(batch["x"]) > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return super().forward(batch)

    before = signal.getsignal(signal.SIGTERM)
    fitter = ll.Fitter(max_steps=2, batch_size=8, auto_find_batch_size=True, output_dir=str(tmp_path), loggers=[])
    fitter.fit(OOMAbove4(), DictDataset(n=48))
    assert fitter.config.batch_size == 4
    assert signal.getsignal(signal.SIGTERM) == before


# -- requeue_slurm_job, against a real `scontrol` stub on PATH --------------------------------
def scontrol_env(tmp_path, monkeypatch, exit_code=0, job="4242"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\nexit {exit_code}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", job)
    return record


def test_requeue_succeeds_with_scontrol(tmp_path, monkeypatch):
    record = scontrol_env(tmp_path, monkeypatch)
    assert requeue_slurm_job() is True
    assert record.read_text() == "requeue 4242\n"


def test_a_failing_scontrol_is_reported_not_taken_for_a_requeue(tmp_path, monkeypatch, caplog):
    record = scontrol_env(tmp_path, monkeypatch, exit_code=1)
    assert requeue_slurm_job() is False
    assert record.read_text() == "requeue 4242\n"
    assert "scontrol requeue 4242 failed" in caplog.text and "requeued SLURM job" not in caplog.text


def test_no_scontrol_on_path_is_not_a_requeue(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here
    assert requeue_slurm_job() is False
    assert "scontrol is not on PATH" in caplog.text


def test_an_empty_slurm_job_id_is_no_job(tmp_path, monkeypatch):
    record = scontrol_env(tmp_path, monkeypatch, job="")
    assert requeue_slurm_job() is False
    assert not record.exists()


def test_a_hanging_scontrol_is_given_up_on(monkeypatch, caplog):
    """scontrol that does not answer within its 60 s: a warning, no requeue, no exception."""
    import lightlike.preemption as pre

    def hangs(cmd, **kw):
        assert kw["timeout"] == 60
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(pre.subprocess, "run", hangs)
    assert requeue_slurm_job() is False
    assert "scontrol requeue 4242 failed" in caplog.text


# -- stale temp folders of processes this one may not signal ----------------------------------
def _cleanup_as_unprivileged(folder: Path) -> list[str] | None:
    """cleanup_stale_temps(folder) run by a user that may not signal pid 1 (this process when it
    may not; else a forked child that became nobody); None when no such user is at hand."""
    from lightlike.checkpoint import cleanup_stale_temps

    def may_signal_pid_1() -> bool:
        try:
            os.kill(1, 0)
        except PermissionError:
            return False
        return True

    if os.geteuid() != 0:
        return None if may_signal_pid_1() else [p.name for p in cleanup_stale_temps(folder)]
    import pwd

    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the check, then _exit
        try:
            os.close(r)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            out = None if may_signal_pid_1() else [p.name for p in cleanup_stale_temps(folder)]
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_cleanup_keeps_the_temp_folder_of_a_process_it_may_not_signal():
    """os.kill(pid, 0) on another user's live process raises PermissionError: that process is
    alive, and its save in progress must be kept (a shared output_dir, another user's job),
    checked as a user that may not signal pid 1, whose temp folder it is here."""
    d = Path(tempfile.mkdtemp(prefix="lightlike-ao-"))
    try:
        d.chmod(0o777)
        live = d / ".checkpoint-3.tmp-1-abcd1234"  # pid 1: alive, not this user's to signal
        live.mkdir()
        live.chmod(0o777)
        removed = _cleanup_as_unprivileged(d)
        if removed is None:
            pytest.skip("no user at hand that may not signal pid 1")
        assert removed == [] and live.is_dir()
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)

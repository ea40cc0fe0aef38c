"""Stop signals to a real process with two DataLoader workers: a fit waiting for a batch that a
hung worker never delivers still ends on SIGTERM (exit code 75, within ``preemption_grace``,
the last checkpoint intact), and a second SIGTERM while the process exits after a preemption
stop does not turn its exit code 75 into death by the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import _descendants

from lightlike.checkpoint import find_latest_valid, verify_checkpoint
from lightlike.preemption import EXIT_PREEMPTED

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")
SCRIPT = Path(__file__).parents[1] / "scripts" / "stop_target.py"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


class Target:
    """``stop_target.py`` running in a process of its own; everything below it is SIGKILLed at
    the end of the test, whatever happened."""

    def __init__(self, out: Path, *args: str):
        self.out = out
        self.p = subprocess.Popen([sys.executable, str(SCRIPT), str(out), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

    def wait_for(self, name: str, limit: float = 300.0) -> None:
        """Until ``OUT/name`` exists (the process is still running then)."""
        deadline = time.monotonic() + limit
        while not (self.out / name).exists():
            if self.p.poll() is not None:
                raise AssertionError(f"exited with {self.p.returncode} before {name}: {self.p.communicate()}")
            assert time.monotonic() < deadline, f"no {name} after {limit} s"
            time.sleep(0.05)

    def finish(self, limit: float) -> tuple[int, str]:
        """(exit code, stderr), or a failure if it is still running after ``limit`` seconds."""
        try:
            _, err = self.p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {limit} s after the signal: {self.p.communicate()}") from None
        return self.p.returncode, err

    def kill(self) -> None:
        for pid in [self.p.pid, *_descendants(self.p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def target(tmp_path):
    made: list[Target] = []

    def start(*args: str) -> Target:
        made.append(Target(tmp_path, *args))
        return made[-1]
    yield start
    for t in made:
        t.kill()
        t.p.communicate()


def test_a_stop_signal_ends_a_fit_waiting_for_a_hung_worker(target, tmp_path):
    """Epoch 1's first batch never comes (both workers sleep in __getitem__). Before, the SIGTERM's
    flag waited for a step boundary that never came: the process was still there minutes later.
    Now, after preemption_grace=3 s of that wait, it exits with code 75 naming the wait, leaving
    checkpoint-4 (epoch 0's last step) as the newest valid one, and its workers end with it."""
    t = target("--hang", "--grace", "3")
    t.wait_for("hung")
    worker = int((tmp_path / "hung").read_text())
    os.kill(t.p.pid, signal.SIGTERM)
    code, err = t.finish(limit=60)
    assert code == EXIT_PREEMPTED, err
    assert "SIGTERM received, but for preemption_grace=3 s the fit has been waiting for the training " \
           "DataLoader's next batch" in err
    assert f"exiting with code {EXIT_PREEMPTED} without a new checkpoint" in err
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    verify_checkpoint(run / "checkpoint-4")
    assert find_latest_valid(run) == run / "checkpoint-4"
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def test_the_grace_counts_from_the_signal_not_from_the_start_of_the_wait(target, tmp_path):
    """The loop has waited for the hung batch longer than the grace (3 s) when SIGTERM comes:
    it still gets its full grace after the signal before exiting with code 75 (a watchdog that
    counted from the start of the wait would exit at once). A lower bound only: a slower machine
    makes the time after the signal longer, never shorter."""
    t = target("--hang", "--grace", "3")
    t.wait_for("hung")
    time.sleep(4.5)  # the wait is already past the grace
    signalled = time.monotonic()
    os.kill(t.p.pid, signal.SIGTERM)
    code, err = t.finish(limit=60)
    after = time.monotonic() - signalled
    assert code == EXIT_PREEMPTED, err
    assert "preemption_grace=3 s" in err
    assert after >= 2.9, f"exited {after:.2f} s after the signal: the grace was counted from the wait's start"


def test_a_second_sigterm_while_the_process_exits_keeps_exit_code_75(target, tmp_path):
    """SIGTERM after step 3: checkpoint-3 is saved and fit raises Preempted, with the handlers it
    found put back (the default ones). A second SIGTERM 0.3 s after fit raised, while the process
    exits (the interpreter's finalization takes seconds here), killed it (-15). Now the exit ignores
    the signal: exit code 75, checkpoint-3 intact."""
    t = target("--term-at", "3")
    t.wait_for("fit-ended")
    time.sleep(0.3)
    os.kill(t.p.pid, signal.SIGTERM)
    code, err = t.finish(limit=60)
    assert code == EXIT_PREEMPTED, err
    assert "SIGTERM received: saving a checkpoint at step 3 and exiting" in err
    run = tmp_path / "run"
    verify_checkpoint(run / "checkpoint-3")
    assert find_latest_valid(run) == run / "checkpoint-3"

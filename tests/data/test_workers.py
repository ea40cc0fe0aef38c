"""DataLoader workers of the loaders lightlike builds end with the process that started them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightlike.data.workers import EndWithParent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import lightlike as ll
    from helpers import Classifier, DictDataset

    out = sys.argv[1]
    pid_file = os.path.join(out, "worker.pid")

    class Slow(DictDataset):
        def __getitem__(self, i):
            if i == 8:  # the third batch: fetched ahead while the first steps train
                with open(pid_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(pid_file + ".tmp", pid_file)
                time.sleep(300)  # a slow read (network storage, a big decode)
            return super().__getitem__(i)

    def kill_self_once_the_worker_is_busy():
        while not os.path.exists(pid_file):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_self_once_the_worker_is_busy, daemon=True).start()
    ll.Fitter(max_steps=10, batch_size=4, num_workers=1, shuffle=False, output_dir=os.path.join(out, "run"),
              loggers=[], model_summary=False, log_level="error").fit(Classifier(), Slow(n=40))
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended (its new parent has not reaped it yet)


def test_a_busy_worker_dies_with_its_killed_parent(tmp_path):
    """torch's worker polls for a dead parent between items only: a worker in a slow
    ``__getitem__`` outlived its SIGKILLed training process by the rest of that item (300 s here)."""
    script = tmp_path / "target.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1])))
    with open(tmp_path / "stderr.txt", "w") as err:  # a file: an orphaned worker would hold a pipe open
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        assert proc.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()
        worker = int((tmp_path / "worker.pid").read_text())
        deadline = time.monotonic() + 30  # a generous bound on a leak, not a speed claim
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the DataLoader worker outlived its killed parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("parent_alive", [True, False])
def test_a_worker_whose_parent_died_before_it_started_exits(parent_alive):
    """Forked just before its parent died, a worker read getppid() == 1 as torch's watchdog
    baseline and waited for work forever (it held a test's output pipe for 300 s in CI)."""
    expected_parent = os.getpid() if parent_alive else os.getpid() + 4_000_000  # no such process
    pid = os.fork()
    if pid == 0:  # the worker
        try:
            EndWithParent(lambda worker_id: os._exit(7), expected_parent)(0)  # the user's init_fn exits 7
        finally:
            os._exit(9)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == (7 if parent_alive else 0)


STUCK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import lightlike as ll
    import torch.utils.data._utils as loader_utils
    from helpers import Classifier, DictDataset

    # torch waits this long for each worker to stop before its SIGTERM (5 s; the default made the test
    # take 25 s): shorter, the same steps (join, SIGTERM, the exit hook)
    loader_utils.MP_STATUS_CHECK_INTERVAL = 0.5

    class Stuck(DictDataset):
        def __getitem__(self, i):
            if i >= 12:
                time.sleep(3600)  # a worker wedged (a hung network read, a deadlock)
            return super().__getitem__(i)

    ll.Fitter(max_steps=2, batch_size=4, num_workers=2, shuffle=False, output_dir=sys.argv[1], loggers=[],
              save_strategy="no", model_summary=False, log_level="error").fit(Classifier(), Stuck(64))
    print("fit returned", flush=True)
""")


def test_a_process_whose_worker_is_stuck_still_exits(tmp_path):
    """The workers ignore the fit's preemption signals (SIGTERM by default), so torch's SIGTERM to
    a worker that does not stop, and multiprocessing's at exit, no longer end it: the process
    waited for it in multiprocessing's exit hook for ever. The exit hook SIGKILLs it after a grace."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK.format(tests=str(Path(__file__).parents[1])))
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], start_new_session=True,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        out, _ = proc.communicate(timeout=150)  # a bound on a hang, not a speed claim
        assert proc.returncode == 0 and "fit returned" in out, (tmp_path / "stderr.txt").read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


ENDINGS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    import lightlike as ll
    from helpers import Classifier, DictDataset

    class Boom(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                raise RuntimeError("boom")

    how, out = sys.argv[1], sys.argv[2]
    if how == "user-loader":  # the user's own loader, used as it is, alive until the interpreter exits
        loader = torch.utils.data.DataLoader(DictDataset(n=32), batch_size=4, num_workers=2, persistent_workers=True)
        ll.Fitter(max_steps=4, output_dir=out, loggers=[], model_summary=False).fit(Classifier(), loader)
        print("fit returned", flush=True)
    else:  # lightlike's loader, its iterator alive in the traceback at exit
        ll.Fitter(max_steps=8, batch_size=4, num_workers=2, output_dir=out, loggers=[], model_summary=False,
                  callbacks=[Boom()]).fit(Classifier(), DictDataset(n=64))
""")


@pytest.mark.parametrize("how", ["user-loader", "exception"])
def test_the_process_ends_after_a_fit_with_workers(tmp_path, how):
    """Workers of a user's loader started with the preemption signals blocked kept them blocked
    for life: multiprocessing's exit hook SIGTERMed and joined them for ever. After an exception,
    torch's SIGCHLD handler (its iterator still alive) raised out of the exit hook at the first
    SIGKILLed worker, leaving the next one to that join."""
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS.format(tests=str(Path(__file__).parents[1])))
    proc = subprocess.Popen([sys.executable, str(script), how, str(tmp_path / "run")], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)  # a bound on a hang, not a speed claim
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if how == "user-loader":
        assert proc.returncode == 0 and "fit returned" in out, err[-3000:]
    else:
        assert proc.returncode == 1 and "RuntimeError: boom" in err, err[-3000:]
    assert "Exception ignored in atexit" not in err, err[-3000:]


FEEDERS = textwrap.dedent("""
    import multiprocessing.queues, os, sys, threading, time
    sys.path.insert(0, {tests!r})
    import lightlike as ll
    from helpers import Classifier, DictDataset

    feed = multiprocessing.queues.Queue._feed

    def slow_to_end(*args):  # a queue's feeder thread, slow to end once its queue is closed
        feed(*args)
        threading.current_thread().ending = True
        time.sleep(0.5)

    multiprocessing.queues.Queue._feed = staticmethod(slow_to_end)
    at_fork = []
    os.register_at_fork(before=lambda: at_fork.append(
        sum(getattr(t, "ending", False) and t.is_alive() for t in threading.enumerate())))
    ll.Fitter(max_epochs=3, batch_size=4, num_workers=2, eval_every=8, shuffle=False, output_dir=sys.argv[1],
              loggers=[], model_summary=False, log_level="error").fit(
        Classifier(), DictDataset(n=32), val=DictDataset(n=16, seed=1))
    print("ending feeder threads at each fork:", at_fork)
""")


def test_workers_start_after_the_queue_threads_of_ended_loaders_have_ended(tmp_path):
    """CPython gh-112275 (3.11.7 has it): a thread ending while another thread forks can leave the
    child holding a lock for ever, and the new DataLoader worker hangs inside os.fork(). A loader
    whose iterator ran out (an evaluation) or was dropped (an epoch's) closes its queues; their
    feeder threads end a moment later, as the next epoch's or evaluation's workers fork. Here
    they are made slow to end: none may still be ending when a worker forks."""
    script = tmp_path / "feeders.py"
    script.write_text(FEEDERS.format(tests=str(Path(__file__).parents[1])))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)  # a bound on a hang, not a speed claim
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = eval(proc.stdout.rsplit(":", 1)[1])
    assert len(counts) == 12, counts  # 3 epochs and 3 evaluations, 2 workers each
    assert counts == [0] * 12, counts


def test_only_closed_queues_feeders_are_waited_for():
    """Another thread's iterator that is shutting down (torch sets its flag first, then joins its
    workers, then closes its queues) has feeders that are not ending yet: waiting for them held a
    second fit in another thread for the whole limit, at every epoch. Only the feeders of closed
    queues are joined, also once the iterator is gone."""
    import gc

    from lightlike.data import workers

    joined = []

    class Feeder:
        def __init__(self, name):
            self.name = name

        def is_alive(self):
            return True

        def join(self, timeout=None):
            joined.append(self.name)

    class Queue:
        def __init__(self, name, closed):
            self._thread, self._closed = Feeder(name), closed

    class ShuttingDown:
        _shutdown = True

        def __init__(self):
            self._index_queues = [Queue("open", False), Queue("closed", True)]
            self._worker_result_queue = Queue("result", False)

    it = ShuttingDown()
    workers._track(it)
    workers._join_ending_feeders()
    assert joined == ["closed"]
    del it
    gc.collect()
    workers._join_ending_feeders()  # dropped: its closed queues' feeders, once more
    assert joined == ["closed", "closed"]
    workers._join_ending_feeders()
    assert joined == ["closed", "closed"]

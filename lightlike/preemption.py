"""Preemption: a signal sets a flag; the loop saves and exits at the next step boundary.

The handler does nothing but record the signal (saving inside a signal handler fails
intermittently: Lightning #21406). At the next optimizer-step boundary the Fitter agrees on the
flag across ranks, writes one checkpoint (unless one was just written at this step), asks SLURM
to requeue the job when running under SLURM with requeue on, and raises ``Preempted``, a
``SystemExit`` whose code is ``EXIT_PREEMPTED`` (75, sysexits' EX_TEMPFAIL: "try again later").
A second signal while saving only sets the flag again; the checkpoint write is atomic anyway.
``fit`` puts back the handlers it found when it ends, ``Preempted`` or not. After a
``Preempted`` the process's exit (its ``atexit`` hooks and the interpreter's finalization, which
can take seconds: the DataLoader iterators, torch) ignores those signals where their handler is
the default one, so that a second signal there does not kill it (-15) instead of code 75.

A step boundary never comes while the loop waits for a DataLoader batch that a hung worker
(a ``__getitem__`` that never returns) will not deliver. From the first signal a watchdog
thread gives such a wait ``preemption_grace`` seconds: past them it logs what the fit was
waiting for and ends the process with code 75 (``os._exit``), without a new checkpoint; the
last committed one is intact (checkpoints are atomic). Only waits for data count: a long
evaluation, save or first step still ends at its step boundary.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

log = logging.getLogger("lightlike")

EXIT_PREEMPTED = 75
_WATCHED: tuple[int, ...] = ()  # the signals a running fit acts on (its DataLoader workers ignore them)
_ACTIVE: PreemptionHandler | None = None  # the handler of the fit running in this process
_EXIT_SIGNALS: tuple[int, ...] = ()  # the signals of the last fit that raised Preempted (see at_exit)


def watched_signals() -> tuple[int, ...]:
    """The preemption signals of the fit running in this process (none outside a fit)."""
    return _WATCHED


class Preempted(SystemExit):
    """Raised by ``fit`` after saving on a preemption signal; exits the process with code 75."""

    def __init__(self, signal_name: str, checkpoint: str | None):
        super().__init__(EXIT_PREEMPTED)
        self.signal_name = signal_name
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return f"preempted by {self.signal_name}; checkpoint {self.checkpoint}; exit code {EXIT_PREEMPTED}"


#: steps between two votes on a stop (several processes, equal shares: no per-step reduction)
VOTE_EVERY = 10


class PreemptionHandler:
    """Installs flag-only handlers for the given signals while a fit runs, and the watchdog that
    ends a process whose loop waits for a batch longer than ``grace`` seconds after a signal."""

    def __init__(self, signals: list[str] | tuple[str, ...]):
        self.signals = list(dict.fromkeys(signal_number(name) for name in signals))  # "TERM" and "SIGTERM" once
        self.received: int | None = None  # kept over an out-of-memory retry (auto_find_batch_size)
        self.vote: Any = None  # the every-10-steps vote in flight (several processes, equal shares)
        self.grace: float | None = None  # seconds a wait for data may last after a signal (None: no limit)
        self.waiting: tuple[str, float] | None = None  # what the loop waits for, since when (monotonic)
        self.signalled_at: float | None = None  # when the first signal arrived (monotonic)
        self.stopping = False  # a step boundary took the stop up: the watchdog has nothing left to do
        self._previous: dict[int, Any] = {}
        self._wake = threading.Event()  # the first signal, or the fit's end

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.signalled_at = time.monotonic()
            self._wake.set()
        self.received = signum

    def install(self, grace: float | None = None) -> None:
        """Handle the signals (from the main thread only), and watch waits for data for longer
        than ``grace`` seconds once one arrives."""
        if self._previous:  # installed already (an out-of-memory retry of the same fit)
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("fit() is not running in the main thread: preemption signals are not handled")
            return
        global _WATCHED, _ACTIVE
        atexit.unregister(at_exit)  # an earlier fit's Preempted was caught: the process goes on
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:  # leave no handler of a fit that never ran
            self.uninstall()
            raise
        _WATCHED, _ACTIVE, self.grace = tuple(self.signals), self, grace
        if grace is not None and self.signals:  # started here, not in the handler (which may interrupt
            # the main thread inside threading's own locks)
            threading.Thread(target=self._watch, name="lightlike-preemption-watchdog", daemon=True).start()

    def uninstall(self) -> None:
        """Put back the signal handlers found at ``install``; the watchdog ends."""
        global _WATCHED, _ACTIVE
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        _WATCHED = ()
        _ACTIVE = None if _ACTIVE is self else _ACTIVE
        self.stopping = True
        self._wake.set()

    def preempted(self, signal_name: str, checkpoint: str | None) -> Preempted:
        """The ``Preempted`` for the fit to raise; the process's exit will ignore a second signal
        (``at_exit``; a later fit in the same process takes that back)."""
        global _EXIT_SIGNALS
        _EXIT_SIGNALS = tuple(self.signals)
        atexit.unregister(at_exit)
        atexit.register(at_exit)
        return Preempted(signal_name, checkpoint)

    def watch(self, batches: Iterator[Any], what: str) -> Iterator[Any]:
        """``batches``, with ``waiting`` saying, while the next one is awaited, ``what`` it is."""
        while True:
            self.waiting = (what, time.monotonic())
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.waiting = None
            yield batch

    def _watch(self) -> None:
        """The watchdog thread: from the first signal until a step boundary takes the stop up,
        a wait for data longer than ``grace`` seconds (counted from the signal at the earliest)
        ends the process."""
        self._wake.wait()
        grace = self.grace
        assert grace is not None
        while not self.stopping and self._previous:
            waiting, since = self.waiting, self.signalled_at
            if waiting is not None and since is not None and time.monotonic() - max(waiting[1], since) >= grace:
                self._give_up(waiting[0])
            time.sleep(min(0.25, grace / 4))

    def _give_up(self, what: str) -> None:
        """Log what the fit waited for, end the DataLoader workers, and exit with code 75."""
        message = (f"{self.signal_name} received, but for preemption_grace={self.grace:g} s the fit has been waiting "
                   f"for {what} (a DataLoader worker stuck in __getitem__ or collate_fn, or reading from storage "
                   f"that does not answer), so no step boundary can save: exiting with code {EXIT_PREEMPTED} "
                   "without a new checkpoint. The last checkpoint committed in output_dir is intact (resume=True "
                   "continues from it); fix the data loading before resuming")
        if log.isEnabledFor(logging.ERROR):
            log.error(message)
        else:
            print(f"lightlike: {message}", file=sys.stderr)
        for handler in [*log.handlers, *logging.getLogger().handlers]:
            try:
                handler.flush()
            except Exception:  # exiting regardless
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        for child in multiprocessing.active_children():  # the workers: the hung one ignores SIGTERM
            if child.daemon:
                child.kill()
        os._exit(EXIT_PREEMPTED)

    def stop_requested(self, strategy: Any, step: int) -> bool:
        """At a step boundary, whether every rank stops now. On one process: whether a signal
        has arrived. On several: a vote started every ``VOTE_EVERY`` steps and read at the next,
        which no rank waits for (no collective wait, no device sync on the step): a signal is
        acted on 10-20 steps later, on every rank at the same step."""
        if strategy.world_size == 1:
            self.stopping = self.received is not None
            return self.stopping
        if step % VOTE_EVERY:
            return False
        vote, self.vote = self.vote, strategy.collectives.reduce_flag_async(self.received is not None)
        self.stopping = vote is not None and vote()
        return self.stopping

    def finish_vote(self) -> None:
        """Wait for the vote every rank started and drop it: its handle must not outlive the group."""
        vote, self.vote = self.vote, None
        if vote is not None:
            vote()

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


def at_exit() -> None:
    """``atexit``, once a fit raised ``Preempted``: the rest of the exit ignores the fit's signals
    whose handler is the default one. ``SIG_IGN``, not a Python handler: the interpreter puts the
    default action back for those before its finalization (``_PySignal_Fini``), where most of the
    exit's time goes (seconds, with torch), and a second signal there ended the process (-15)."""
    for sig in _EXIT_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, signal.SIG_IGN)


def waiting_for(batches: Iterator[Any], what: str) -> Iterator[Any]:
    """``batches`` (an iterator), telling the running fit's watchdog while the loop waits for
    the next one (``what``: "the training DataLoader's next batch"); as they are outside a fit."""
    handler = _ACTIVE
    if handler is None or handler.grace is None or threading.current_thread() is not threading.main_thread():
        return batches
    return handler.watch(batches, what)


def signal_number(name: str) -> int:
    """The number of the signal ``name`` ("TERM", "SIGTERM", "usr1"); a ConfigError for one that is
    unknown or that no process can catch."""
    from lightlike.errors import ConfigError

    try:
        sig = int(getattr(signal.Signals, name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()))
    except (AttributeError, TypeError) as e:
        raise ConfigError(f"preemption_signals: unknown signal {name!r} (e.g. 'SIGTERM', 'SIGUSR1')") from e
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"preemption_signals: {name!r} cannot be caught by any process; use signals a job "
                          "scheduler sends first, e.g. 'SIGTERM', 'SIGUSR1'")
    return sig


def requeue_slurm_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID`` when under SLURM; tolerate its absence."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60, capture_output=True)
    except FileNotFoundError:
        log.warning("SLURM_JOB_ID=%s but scontrol is not on PATH: job not requeued", job)
        return False
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        log.warning("scontrol requeue %s failed: %s", job, e)
        return False
    log.info("requeued SLURM job %s", job)
    return True

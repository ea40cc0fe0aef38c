"""Preemption: a signal sets a flag; the loop saves and exits at the next step boundary.

The handler does nothing but record the signal (saving inside a signal handler fails
intermittently: Lightning #21406). At the next optimizer-step boundary the Fitter agrees on the
flag across ranks, writes one checkpoint (unless one was just written at this step), asks SLURM
to requeue the job when running under SLURM with requeue on, and raises ``Preempted``, a
``SystemExit`` whose code is ``EXIT_PREEMPTED`` (75, sysexits' EX_TEMPFAIL: "try again later").
A second signal while saving only sets the flag again; the checkpoint write is atomic anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("lightlike")

EXIT_PREEMPTED = 75
_WATCHED: tuple[int, ...] = ()  # the signals a running fit acts on (its DataLoader workers ignore them)


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
    """Installs flag-only handlers for the given signals while a fit runs."""

    def __init__(self, signals: list[str] | tuple[str, ...]):
        self.signals = list(dict.fromkeys(_signal(name) for name in signals))  # "TERM" and "SIGTERM" once
        self.received: int | None = None  # kept over an out-of-memory retry (auto_find_batch_size)
        self.vote: Any = None  # the every-10-steps vote in flight (several processes, equal shares)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def install(self) -> None:
        if self._previous:  # installed already (an out-of-memory retry of the same fit)
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("fit() is not running in the main thread: preemption signals are not handled")
            return
        global _WATCHED
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:  # leave no handler of a fit that never ran
            self.uninstall()
            raise
        _WATCHED = tuple(self.signals)

    def uninstall(self) -> None:
        global _WATCHED
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        _WATCHED = ()

    def stop_requested(self, strategy: Any, step: int) -> bool:
        """At a step boundary, whether every rank stops now. On one process: whether a signal
        has arrived. On several: a vote started every ``VOTE_EVERY`` steps and read at the next,
        which no rank waits for (no collective wait, no device sync on the step): a signal is
        acted on 10-20 steps later, on every rank at the same step."""
        if strategy.world_size == 1:
            return self.received is not None
        if step % VOTE_EVERY:
            return False
        vote, self.vote = self.vote, strategy.collectives.reduce_flag_async(self.received is not None)
        return vote is not None and vote()

    def finish_vote(self) -> None:
        """Wait for the vote every rank started and drop it: its handle must not outlive the group."""
        vote, self.vote = self.vote, None
        if vote is not None:
            vote()

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


def _signal(name: str) -> int:
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

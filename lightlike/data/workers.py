"""DataLoader workers that end with the process that started them.

torch's worker loop notices a dead parent by polling ``os.getppid()`` between items, against the
value it read when the worker started. That misses two cases, both seen here when a training
process was SIGKILLed (the OOM killer, a scheduler's ``kill -9``, the kill tests): a worker busy
in a slow ``__getitem__`` or ``collate_fn`` runs on until that item is done, and a worker forked
just before its parent died reads ``getppid() == 1`` at its start, so for it the parent never
dies: it waits for work forever, holding its memory (and any pipe it inherited).

The loaders lightlike builds (from Datasets, and the ones it rebuilds from the user's DataLoaders
to split them) therefore start their workers through ``EndWithParent``: on Linux the kernel sends
the worker SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and a worker whose parent is
already gone when it starts exits at once. A DataLoader of the user's that is used as it is
keeps its own ``worker_init_fn``.

``EndWithParent`` also has the worker ignore the fit's preemption signals: a scheduler signals
every process of the job (torchrun forwards its SIGTERM to the process group, SLURM signals the
job step), and torch's worker handler ends a worker on a SIGTERM its parent did not send; the
training process then failed at the next batch ("DataLoader worker ... is killed by signal:
Terminated") instead of saving. The training process acts on the signal and ends its workers.
torch ends a worker that does not stop when asked (stuck in a ``__getitem__``) with SIGTERM too,
which such a worker now ignores: it lives on until the process exits, where ``multiprocessing``
would SIGTERM its daemonic children and join them for ever. ``_end_daemonic_children`` runs
before that: SIGTERM, a grace period of ``EXIT_GRACE`` seconds, then SIGKILL for the survivors.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from typing import Any

from lightlike.preemption import watched_signals

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_AT_EXIT = False  # whether _end_daemonic_children is registered
EXIT_GRACE = 2.0  # seconds a daemonic child has to end after its SIGTERM at exit


class EndWithParent:
    """A ``worker_init_fn`` that ties the worker's life to its parent's, then calls ``init_fn``."""

    def __init__(self, init_fn: Callable[[int], Any] | None, parent_pid: int | None):
        self.init_fn = init_fn
        self.parent_pid = parent_pid
        global _AT_EXIT
        if not _AT_EXIT:  # registered after multiprocessing's own exit hook, so it runs before it
            atexit.register(_end_daemonic_children)
            _AT_EXIT = True

    def __getstate__(self) -> dict[str, Any]:
        # pickled for a spawned (or forkserver) worker, which starts without the parent's module
        # state: the signals to ignore go with it (a forked worker reads the inherited state)

        return {**self.__dict__, "signals": watched_signals()}

    def __call__(self, worker_id: int) -> None:
        ignored = self.__dict__.get("signals") or watched_signals()
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)  # the training process acts on it (above)
        if ignored:  # blocked while this worker started (start_workers): a signal pending now is dropped
            signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            except (OSError, AttributeError):  # no prctl here: torch's own polling remains
                pass
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            os._exit(0)  # the parent died before this worker started: nobody will read its batches
        if self.init_fn is not None:
            self.init_fn(worker_id)


def _end_daemonic_children() -> None:
    """At exit, before ``multiprocessing``'s own hook (which SIGTERMs the daemonic children, then
    joins them without a limit): the same SIGTERM, then SIGKILL for every child still alive after
    ``EXIT_GRACE`` seconds (a worker of lightlike's loaders ignores SIGTERM, above). torch's
    SIGCHLD handler, still installed while an iterator lives, would raise out of this hook at the
    first killed worker and leave the others to that join: it is reset first."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    children = [c for c in multiprocessing.active_children() if c.daemon]
    for child in children:
        child.terminate()
    deadline = time.monotonic() + EXIT_GRACE
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    left = [c for c in children if c.is_alive()]
    for child in left:
        child.kill()
    for child in left:
        child.join(1.0)


def end_with_parent(init_fn: Callable[[int], Any] | None, num_workers: int,
                    multiprocessing_context: Any = None) -> Callable[[int], Any] | None:
    """``init_fn`` wrapped in ``EndWithParent`` when the loader has workers (else as it is). The
    parent is this process, except under ``forkserver``, whose server starts the workers."""
    if not num_workers or isinstance(init_fn, EndWithParent):
        return init_fn
    return EndWithParent(init_fn, None if _start_method(multiprocessing_context) == "forkserver" else os.getpid())


def _start_method(context: Any) -> str:
    """The start method of a DataLoader's ``multiprocessing_context``: its own, the one in force,
    or the platform's default (the list's first)."""
    if context is not None:
        return context if isinstance(context, str) else str(context.get_start_method())

    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


#: weak references to the DataLoader iterators with workers started here, while they live
_STARTED: list[weakref.ref] = []
#: queue feeder threads of those iterators since dropped (joined before the next workers start)
_ENDING: list[threading.Thread] = []
FEEDER_JOIN_LIMIT = 5.0  # seconds, in all, to wait for ending feeder threads before a fork
#: the iterators ``start_workers`` started within the innermost ``workers_released_on_error``
#: block of this thread (another thread's, or an outer fit's, are not its to end)
_IN_CALL: contextvars.ContextVar[list[weakref.ref] | None] = contextvars.ContextVar("lightlike_iterators",
                                                                                      default=None)


def _ending(queues: Any) -> list[threading.Thread]:
    """The feeder threads of those queues that are closed (each then ends once it has flushed):
    an iterator of another thread that is shutting down has not closed its queues yet, and its
    feeders are not ending."""
    return [t for q in queues if getattr(q, "_closed", False) and (t := getattr(q, "_thread", None)) is not None]


def _queues(it: Any) -> list[Any]:
    return [*getattr(it, "_index_queues", ()), getattr(it, "_worker_result_queue", None)]


def _track(it: Any) -> None:
    """Remember an iterator's queues, so that their feeder threads can be joined once it ends;
    and the iterator, for the call that started it (``workers_released_on_error``)."""
    in_call = _IN_CALL.get()
    if in_call is not None and hasattr(it, "_shutdown_workers"):
        in_call.append(weakref.ref(it))
    if not hasattr(it, "_index_queues") or any(r() is it for r in _STARTED):  # a persistent one comes back
        return

    queues = _queues(it)

    def dropped(ref: weakref.ref) -> None:
        # after the iterator's __del__ shut its workers down: its queues' feeders are ending
        _STARTED.remove(ref)
        _ENDING.extend(_ending(queues))

    _STARTED.append(weakref.ref(it, dropped))


def _join_ending_feeders() -> None:
    """Join the feeder threads of the iterators that have shut their workers down (ran out, or
    dropped), before new workers fork: a thread ending while another forks can leave the child
    a lock held for ever (CPython gh-112275, not fixed in 3.11.7): the new worker hangs inside
    ``os.fork()`` and the training process waits for it. A shut-down iterator's queues are
    closed, so their feeders end at once; live iterators' feeders stay (they are not ending)."""
    threads, _ENDING[:] = _ENDING[:], []
    for ref in _STARTED:
        it = ref()
        if it is not None and getattr(it, "_shutdown", False):
            threads += _ending(_queues(it))
    deadline = time.monotonic() + FEEDER_JOIN_LIMIT
    for t in threads:
        if t.is_alive() and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


def start_workers(loader: Any) -> Any:
    """``iter(loader)``, once the queue threads of earlier iterators that ended have ended
    (``_join_ending_feeders``); for a loader lightlike built (its workers start through ``EndWithParent``),
    with the fit's preemption signals blocked in this thread while the workers start: the mask
    is inherited through fork and spawn, so a signal sent to the whole job while a worker starts
    up, before ``EndWithParent`` makes it ignore the signal, stays pending there instead of ending
    it through torch's handler; ``EndWithParent`` unblocks it (discarded, being ignored). Here it
    is delivered when the block ends. Not for a DataLoader of the user's used as it is (its
    workers would keep the signals blocked, and never end on a SIGTERM), nor under forkserver
    (the fork server would keep them blocked for every process it forks later)."""
    if not getattr(loader, "num_workers", 0):
        return iter(loader)
    _join_ending_feeders()
    signals = watched_signals()
    method = _start_method(getattr(loader, "multiprocessing_context", None))
    if not signals or method == "forkserver" \
            or not isinstance(getattr(loader, "worker_init_fn", None), EndWithParent) \
            or threading.current_thread() is not threading.main_thread():
        it = iter(loader)
        _track(it)
        return it
    if method != "fork":
        # started on the first spawn, the resource tracker unblocks SIGTERM in this thread when it
        # is up (it blocks it for its own start): start it first, so that spawned workers start
        # with the signals still blocked

        resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        it = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    _track(it)
    return it


@contextlib.contextmanager
def workers_released_on_error() -> Iterator[None]:
    """On an error leaving the block, shut down the workers of the iterators ``start_workers``
    started in it that are still alive (not persistent ones, which their DataLoader reuses):
    the traceback a notebook keeps holds the frames that hold them (a worker's own error is
    raised from inside the iterator), and with them its workers, queue threads and descriptors."""
    started: list[weakref.ref] = []
    token = _IN_CALL.set(started)
    try:
        yield
    except BaseException:
        for ref in started:
            it = ref()
            if it is not None and not getattr(it, "_persistent_workers", False):
                it._shutdown_workers()
        raise
    finally:
        _IN_CALL.reset(token)

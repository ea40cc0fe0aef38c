"""Failing fast on several processes: every rank says who failed where, and teardown waits for
no peer after a failure (the launcher ends the others, whose collectives then fail at once). A
call that succeeded on one rank returns only once every rank's did (one agreement at its end)."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightlike.errors import LightlikeError, on_every_rank
from lightlike.preemption import Preempted

if TYPE_CHECKING:
    from lightlike.fitter import Fitter

log = logging.getLogger("lightlike")
T = TypeVar("T")
_calls = itertools.count(1)  # every rank enters the same calls in the same order: one number each


@contextlib.contextmanager
def failing_fast(fitter: Fitter) -> Iterator[None]:
    """Around fit/validate/test/predict: on an error, every rank says who failed where, and
    the strategy is told not to wait for its peers at teardown; the launcher (torchrun /
    srun) then ends the others, whose pending collectives fail instead of waiting."""
    call = next(_calls)
    try:
        yield
    except BaseException as error:
        strategy = fitter.strategy
        rank, world = (strategy.global_rank, strategy.world_size) if strategy else (0, 1)
        # in a train step, the step being taken (as lightlike's own errors number it)
        step = fitter.state.global_step + (fitter.phase == "train step")
        lost = _peer_lost(error)  # a peer's failure ended this rank's collective: not where the fault is
        line = f"rank {rank} of {world} {'stopped' if lost else 'failed'} during {fitter.phase} at step {step}: "
        alone = not isinstance(error, Preempted) and not getattr(error, "on_every_rank", False)
        if strategy is not None and alone:
            # a peer may sit in another collective: teardown waits for none; the peers read this
            # rank's line where they stopped (the process group's store)
            strategy.collectives.note_failure(None if lost else f"{line}{type(error).__name__}: {error}", call)
        if world > 1 and not isinstance(error, (Preempted, KeyboardInterrupt)) \
                and not getattr(error, "_lightlike_logged", False):  # one process: its traceback says it
            peers = "; ".join(strategy.collectives.failed_peers(call)) if lost else ""  # type: ignore[union-attr]
            if peers and hasattr(error, "add_note"):  # the traceback names the failed rank too
                error.add_note(f"lightlike: {peers}")
            cause = (f"{peers} (here: " if peers else "a peer process failed or exited (its own line says why): ") \
                if lost else ""
            log.error("%s%s%s: %s%s", line, cause, type(error).__name__, error, ")" if peers else "")
            with contextlib.suppress(AttributeError):  # once (a search trial's fit logged it already)
                error._lightlike_logged = True  # type: ignore[attr-defined]
        checkpointer = getattr(fitter, "checkpointer", None)
        if checkpointer is not None and checkpointer.in_flight is not None:  # a checkpoint written before it failed
            checkpointer.publish_sealed()
        fitter.callbacks.call("on_exception", fitter, fitter.state, fitter.control, error)
        raise


def decided_on_main(strategy: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the main rank, its result (or its lightlike error) sent to every rank: one
    decision for all of them (which checkpoint to resume, whether ``output_dir`` may be used), so
    that no rank goes its own way into collectives the others never join. The error is raised
    on every rank at the same point."""
    result, problem = None, None
    if strategy.is_global_zero:
        try:
            result = fn(*args)
        except LightlikeError as error:
            problem = error
    if strategy.world_size > 1:
        result, problem = strategy.collectives.broadcast_object((result, problem))
    if problem is not None:
        raise on_every_rank(problem)
    return result  # type: ignore[return-value]


def _peer_lost(error: BaseException) -> bool:
    """Whether a collective failed because a peer process went away (gloo's and the TCP store's
    messages; NCCL's DistNetworkError), rather than this rank failing on its own."""
    network_error = getattr(torch.distributed, "DistNetworkError", None)
    if network_error is not None and isinstance(error, network_error):
        return True
    text = str(error)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


@contextlib.contextmanager
def guarded(fitter: Fitter) -> Iterator[None]:
    """Around fit/validate/test/predict: every rank fails fast (``failing_fast``), also when a
    peer fails after the call's last collective (``all_ranks_succeeded``); torch's deterministic
    algorithms for the call only (``deterministic=True``); a failure's traceback keeps no
    DataLoader worker alive."""
    from lightlike.data.workers import workers_released_on_error
    from lightlike.utils.seed import deterministic_mode

    with failing_fast(fitter):
        with deterministic_mode(fitter.config.deterministic), workers_released_on_error():
            yield
        all_ranks_succeeded(fitter)


def all_ranks_succeeded(fitter: Fitter) -> None:
    """The end of a call that succeeded on this rank: one flag all-reduce on several processes,
    which every rank joins only after its own call succeeded. A peer that failed after the call's
    last collective (in ``on_evaluate`` of a fit's last evaluation, in ``compute_metrics``) never
    joins; its process exits and this rank's all-reduce fails at once: it raises, as a rank in any
    other collective does ("stopped ... a peer process failed"), instead of returning normally
    into the caller's code (an export, a push) until the launcher ends it. Once per call, never
    per step."""
    strategy = fitter.strategy
    if strategy is not None and strategy.world_size > 1:
        strategy.collectives.reduce_flag(False)

"""``min_epochs`` / ``min_steps``: a stop asked for before both are reached waits for them, as
Lightning's ``Trainer(min_epochs=, min_steps=)``. The limits ``max_steps`` / ``max_epochs`` end
the run whatever they say."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightlike.config import FitConfig
    from lightlike.state import Control, FitState

log = logging.getLogger("lightlike")


def minimum_reached(config: FitConfig, state: FitState) -> bool:
    """Whether ``min_steps`` optimizer steps and ``min_epochs`` whole epochs are done."""
    return (state.global_step >= (config.min_steps or 0)) and state.epoch_index >= (config.min_epochs or 0)


def hold_stop(config: FitConfig, state: FitState, control: Control) -> None:
    """At a step boundary: a ``should_training_stop`` asked for before the minimum is reached is
    taken back and kept in ``state.stop_deferred`` (checkpointed, so a resumed run keeps it); once
    the minimum is reached a deferred stop is asked for again, and the run ends at this boundary.
    A stop set again while it waits is the same stop (said once)."""
    if control.should_training_stop:
        if minimum_reached(config, state):
            state.stop_deferred = False
            return
        control.should_training_stop = False
        if not state.stop_deferred:
            log.info("a stop was asked for at step %d, but min_epochs=%r or min_steps=%r has not been reached: "
                     "training goes on until it is", state.global_step, config.min_epochs, config.min_steps)
        state.stop_deferred = True
    elif state.stop_deferred and minimum_reached(config, state):
        state.stop_deferred = False
        control.should_training_stop = True

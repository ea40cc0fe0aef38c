"""Callbacks: twelve events, one mutable ``Control``, the read-mostly ``FitState``.

Every event receives ``(fitter, state, control)`` plus its payload. Callbacks steer the loop
only through ``control`` flags: set them on ``control``, or return them (a ``Control``, or a
mapping of flag names to True/False, as in the HF Trainer's docs); they may read
``fitter.module`` and ``fitter.config``.
Callbacks with state (counters, best values) implement ``state_dict``/``load_state_dict`` and
that state is saved in checkpoints under ``state_key``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightlike.errors import CallbackReturnError, ConfigError
from lightlike.state import Control

if TYPE_CHECKING:
    import torch

    from lightlike.fitter import Fitter
    from lightlike.state import FitState

EVENTS = (
    "on_fit_start",
    "on_fit_end",
    "on_epoch_start",
    "on_epoch_end",
    "on_step_start",
    "on_step_end",
    "on_before_optimizer_step",
    "on_log",
    "on_evaluate",
    "on_eval_batch_end",
    "on_save",
    "on_exception",
)


class Callback:
    """Override the events you need; all default to doing nothing."""

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def on_fit_start(self, fitter: Fitter, state: FitState, control: Control) -> None: ...
    def on_fit_end(self, fitter: Fitter, state: FitState, control: Control) -> None: ...
    def on_epoch_start(self, fitter: Fitter, state: FitState, control: Control) -> None: ...
    def on_epoch_end(self, fitter: Fitter, state: FitState, control: Control) -> None: ...
    def on_step_start(self, fitter: Fitter, state: FitState, control: Control) -> None: ...
    def on_step_end(self, fitter: Fitter, state: FitState, control: Control) -> None: ...

    def on_before_optimizer_step(
        self, fitter: Fitter, state: FitState, control: Control, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients are unscaled and clipped here, before ``optimizer.step()``."""

    def on_log(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None: ...
    def on_evaluate(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None: ...
    def on_save(self, fitter: Fitter, state: FitState, control: Control, path: str) -> None: ...

    def on_eval_batch_end(self, fitter: Fitter, state: FitState, control: Control, name: str, batch: int,
                          num_batches: int | None) -> None:
        """After batch ``batch`` (from 0) of evaluation set ``name`` (``"val"``), of this rank's
        ``num_batches`` (None when the loader has no length); during a fit's evaluations only.
        Called only when a callback overrides it, so an evaluation nobody watches pays nothing."""
    def on_exception(self, fitter: Fitter, state: FitState, control: Control, error: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def init_args(self) -> dict[str, Any] | None:
        """The arguments this callback was built with, saved beside its state: a resume restores
        the state only into a callback built with the same ones (as the HF Trainer's
        ``ExportableState``). None (the default): not compared."""
        return None


#: where ``CallbackList.state_dict`` keeps the callbacks' ``init_args`` (by ``state_key``)
ARGS_KEY = "__init_args__"

#: the flags a callback may set, by name: ``Control``'s fields, which are the HF Trainer's names
FLAGS = tuple(f.name for f in dataclasses.fields(Control))


def apply_returned(returned: Any, control: Control, handler: Any, event: str) -> None:
    """Act on what a callback's handler returned (not None): a ``Control`` sets the flags it has
    set (the loop's own ``control`` returned, as HF callbacks do, changes nothing; a fresh one's
    unset flags clear none another callback set); a mapping sets each named flag to its value
    (``{"should_training_stop": True}``). Anything else, a name that is no flag, or a value that
    is not True/False, is a ``CallbackReturnError`` naming the callback and the event: a return
    value the loop ignored would be a stop, save or evaluation silently not done."""
    owner = f"{type(getattr(handler, '__self__', handler)).__name__}.{event}"
    if isinstance(returned, Control):
        for name in FLAGS:
            if getattr(returned, name):
                setattr(control, name, True)
        return
    if not isinstance(returned, Mapping):
        shown = repr(returned)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise CallbackReturnError(f"{owner} returned {shown} ({type(returned).__name__}): a callback returns None, "
                                  "a Control, or a mapping of flag names to True/False such as "
                                  "{'should_training_stop': True}; or set the flag on control")
    for name, value in returned.items():
        if name not in FLAGS:
            close = difflib.get_close_matches(str(name), FLAGS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise CallbackReturnError(f"{owner} returned the flag {name!r}, which is not one{hint}; the flags are: "
                                      f"{', '.join(FLAGS)}")
        if not isinstance(value, bool):
            raise CallbackReturnError(f"{owner} returned {name}={value!r} ({type(value).__name__}): a flag is True "
                                      f"or False; write {{{name!r}: True}}")
    for name, value in returned.items():  # all checked first: a bad mapping sets nothing
        setattr(control, name, value)


def _overrides(cb: Callback, event: str) -> bool:
    method = getattr(cb, event)
    return getattr(method, "__func__", method) is not getattr(Callback, event)


#: the hooks of Lightning's ``Callback`` and the HF Trainer's ``TrainerCallback`` that lightlike
#: never calls, and the event that takes their place (None: none does)
OTHER_HOOKS: dict[str, str | None] = {
    "on_train_start": "on_fit_start", "on_train_begin": "on_fit_start", "on_train_end": "on_fit_end",
    "on_train_epoch_start": "on_epoch_start", "on_epoch_begin": "on_epoch_start", "on_train_epoch_end": "on_epoch_end",
    "on_train_batch_start": "on_step_start", "on_step_begin": "on_step_start", "on_train_batch_end": "on_step_end",
    "on_pre_optimizer_step": "on_before_optimizer_step", "on_optimizer_step": "on_step_end",
    "on_validation_start": "on_evaluate", "on_validation_end": "on_evaluate",
    "on_validation_epoch_start": "on_evaluate", "on_validation_epoch_end": "on_evaluate",
    "on_validation_batch_end": "on_eval_batch_end", "on_prediction_step": "on_eval_batch_end",
    "on_save_checkpoint": "on_save", "on_init_end": None, "on_substep_end": None,
    "on_before_backward": None, "on_after_backward": None, "on_before_zero_grad": None,
    "on_test_start": None, "on_test_end": None, "on_predict_start": None, "on_predict_end": None,
    "on_load_checkpoint": None, "on_sanity_check_start": None, "on_sanity_check_end": None,
}


def check_callbacks(callbacks: list[Any]) -> None:
    """Each entry a ``Callback`` (else one ``ConfigError`` naming what it is); a hook named as in
    Lightning or the HF Trainer that lightlike never calls is warned about, naming the event
    that takes its place (a method that silently never runs would be a stop or a save not done)."""
    for cb in callbacks:
        if not isinstance(cb, Callback):
            what = "a class, not an instance: pass " + f"{cb.__name__}()" if isinstance(cb, type) else \
                f"an instance of {type(cb).__name__}"
            raise ConfigError(f"callbacks= holds {what}, not a lightlike Callback: subclass lightlike.Callback and "
                              f"override its events ({', '.join(EVENTS[:6])}, ...)", settings=("callbacks",))
        for name, event in OTHER_HOOKS.items():
            if callable(getattr(type(cb), name, None)):
                instead = (f"override {event}(fitter, state, control{', ...' if event in PAYLOAD else ''}) instead"
                           if event else "lightlike has no such event (no hook inside the step: the loop in "
                           "lightlike/fitter.py is meant to be read)")
                warnings.warn(f"{type(cb).__name__}.{name} is a Lightning / HF Trainer hook that lightlike never "
                              f"calls: {instead}", UserWarning, stacklevel=3)


#: events called with more than (fitter, state, control)
PAYLOAD = ("on_log", "on_evaluate", "on_eval_batch_end", "on_save", "on_exception")


class CallbackList:
    """Calls an event on every callback, in order."""

    def __init__(self, callbacks: list[Callback]):
        check_callbacks(callbacks)
        self.callbacks = list(callbacks)
        # per event, the bound methods of the callbacks that override it: an event nobody
        # listens to costs one dict lookup per step
        self._handlers: dict[str, list[Any]] = {
            event: [getattr(cb, event) for cb in self.callbacks if _overrides(cb, event)] for event in EVENTS
        }
        # checked when the fit starts, not at its first save (a preemption save would be lost)
        keys = [cb.state_key for cb in self.callbacks if hasattr(cb, "state_dict") and _overrides(cb, "state_dict")]
        shared = sorted({k for k in keys if keys.count(k) > 1})
        if shared:
            raise ConfigError(f"two callbacks with state share state_key {shared[0]!r}: their checkpointed states "
                              "would collide; give each a distinct state_key (a property of the callback)")

    def call(self, event: str, fitter: Fitter, state: FitState, control: Control, *args: Any) -> None:
        """Call every callback's handler of ``event``, in order; a handler's returned flags are set."""
        for handler in self._handlers[event]:
            returned = handler(fitter, state, control, *args)
            if returned is not None:  # the one test a handler that returns nothing costs
                apply_returned(returned, control, handler, event)

    def hook(self, event: str, fitter: Fitter) -> Callable[..., None] | None:
        """``event``'s call with the fit's (fitter, state, control) bound, ``hook(*payload)``, or
        None where no callback listens to it (then the loop makes no call at all)."""
        if not self._handlers[event]:
            return None
        return functools.partial(self.call, event, fitter, fitter.state, fitter.control)

    def call_on_save(self, fitter: Fitter, state: FitState, control: Control, path: str) -> None:
        """``on_save`` comes after the step's checkpoint. A stop set there ends the run at it; a
        flag that would change what the step did is dropped, with a warning: the checkpoint
        cannot hold it, so a run killed before the next step would resume without it and differ."""
        names = ("should_log", "should_evaluate", "should_save", "should_epoch_stop")
        for handler in self._handlers["on_save"]:
            before = [getattr(control, n) for n in names]
            returned = handler(fitter, state, control, path)
            if returned is not None:
                apply_returned(returned, control, handler, "on_save")
            late = [n for n, was in zip(names, before, strict=True) if getattr(control, n) and not was]
            if late:
                for n in late:
                    setattr(control, n, False)
                owner = type(getattr(handler, "__self__", handler)).__name__
                msg = (f"control.{', control.'.join(late)} set in {owner}.on_save is ignored: on_save comes after the "
                       "step's checkpoint, which cannot hold it; set it in on_step_end, on_log or on_evaluate "
                       "(should_training_stop set in on_save does end the run)")
                func = getattr(handler, "__func__", handler)
                code, where = getattr(func, "__code__", None), getattr(func, "__globals__", None)
                if code is None or where is None:
                    warnings.warn(msg, stacklevel=3)
                else:  # pointed at the callback's on_save, where the flag was set (once there, as warn does)
                    warnings.warn_explicit(msg, UserWarning, code.co_filename, code.co_firstlineno,
                                           module=where.get("__name__"),
                                           registry=where.setdefault("__warningregistry__", {}))

    def state_dict(self) -> dict[str, Any]:
        """Each callback's state by ``state_key``; their ``init_args`` under ``ARGS_KEY``."""
        out: dict[str, Any] = {}
        args: dict[str, Any] = {}
        for cb in self.callbacks:
            st = cb.state_dict()
            if st:
                if cb.state_key in out:
                    raise ValueError(
                        f"two callbacks share state_key {cb.state_key!r}; give each a distinct state_key"
                    )
                out[cb.state_key] = st
                if cb.init_args() is not None:
                    args[cb.state_key] = cb.init_args()
        if args:
            out[ARGS_KEY] = args
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Each callback's saved state, unless it was saved with other ``init_args`` than the
        callback's now: then the callback keeps its new arguments and starts afresh, with a
        warning naming it and each argument that changed."""
        saved_args = state.get(ARGS_KEY, {})
        for cb in self.callbacks:
            if cb.state_key not in state:
                continue
            before, now = saved_args.get(cb.state_key), cb.init_args()
            if before is not None and now is not None and before != now:
                changed = ", ".join(f"{k}={before.get(k)!r} -> {now.get(k)!r}"
                                    for k in sorted(before.keys() | now.keys()) if before.get(k) != now.get(k))
                warnings.warn(f"the checkpoint holds the state of {type(cb).__name__} ({cb.state_key}) built with other "
                              f"arguments ({changed}): it is not restored; this run's {type(cb).__name__} keeps its "
                              "new arguments and starts afresh", UserWarning, stacklevel=2)
                continue
            cb.load_state_dict(state[cb.state_key])

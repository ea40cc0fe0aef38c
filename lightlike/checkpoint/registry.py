"""The registry: what a training checkpoint holds, one named entry per piece of state.

An ``Entry`` names an object and the file it goes to (``files.py``, the one table of names).
The ``Checkpointer`` writes and loads the entries and nothing else, besides the weights and
optimizer state that the strategy writes in its own layout. Adding a piece of state to every
checkpoint is one entry in ``Registry.of_fit``; a user adds theirs with
``Fitter(states={"ema": ema})`` (``user_states``), one ``state-<name>.pt`` each.

What an entry's object provides:

- a global entry (written by the main rank, loaded by every rank): ``state_dict()`` (tensors and
  plain Python values, or JSON for a ``.json`` file) and ``load_state_dict(state)``;
- a per-rank entry: ``rank_state_dict()`` (this rank's part, gathered to the main rank),
  ``state_dict(parts)`` (the file, from every rank's part) and ``load_state_dict(saved, loading)``
  (its own part, or what another number of processes asks for);
- a built-in entry's object may add ``check_resume(loading)``, which refuses a checkpoint
  before anything is restored, and ``after_load(loading)``, its post-load policy, run once every
  entry is restored (a user's state is only saved and loaded: methods of its own by those names
  are never called).
"""

from __future__ import annotations

import collections
import io
import json
import logging
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightlike.checkpoint.files import (
    BUILT_IN_NAMES,
    FILES,
    USER_STATE_FILES,
    USER_STATE_NAME,
    user_state_file,
)
from lightlike.checkpoint.frozen import BaseFingerprint
from lightlike.checkpoint.settings import RunSettings
from lightlike.checkpoint.training import Hyperparameters, RandomState, torch_load
from lightlike.errors import CheckpointError, ConfigError

log = logging.getLogger("lightlike")


@dataclass(frozen=True)
class Loading:
    """A resume in progress: the checkpoint, each restored entry's state as read from it (by
    name; a file that is absent and not required is not there), and this run's config and place."""

    path: Path
    saved: dict[str, Any]
    config: Any
    rank: int
    world_size: int


@dataclass(frozen=True)
class Entry:
    """One named piece of a checkpoint: ``obj`` (the protocol above) written to ``file``."""

    name: str
    obj: Any
    file: str
    per_rank: bool = False  # every rank's part, gathered into one file
    training: bool = True  # training state: absent from a weights-only checkpoint (save_only_model)
    restore: bool = True  # loaded back by a resume (False: a record for readers, hparams.json)
    required: bool = True  # a resume refuses a checkpoint without it (else: a state of None is not written)
    check: Callable[[Any], None] | None = None  # refuses, at a save, a state no resume could load
    user: bool = False  # given in Fitter(states=...)


class Registry:
    """The entries of a fit's checkpoints, by name, in the order they are written and loaded."""

    def __init__(self, entries: Iterable[Entry] = ()):
        self.entries: dict[str, Entry] = {}
        for entry in entries:
            self.add(entry)

    @classmethod
    def of_fit(cls, config: Any, strategy: Any, *, module: Any, optimizer: Any, scheduler: Any, callbacks: Any,
               loop: Any, states: Mapping[str, Any] | None = None, base: Any = None) -> Registry:
        """What every checkpoint of a fit holds besides the strategy's files, then the user's
        ``states``. Each built-in entry owns its post-load policy: ``config`` the changed settings,
        ``trainer_state`` the best checkpoint, ``rng`` another number of processes, and ``base_fingerprint``
        (``base``, a ``BaseFingerprint`` taken at set-up) refuses a checkpoint trained on another base."""
        entries = [
            Entry("hparams", Hyperparameters(module), FILES["hparams"], training=False, restore=False, required=False),
            Entry("base_fingerprint", base if base is not None else BaseFingerprint(), FILES["base_fingerprint"],
                  training=False, required=False),
            Entry("config", RunSettings(config, module, optimizer, scheduler, loop.order_key), FILES["config"],
                  training=False, required=False),
            *([Entry("scheduler", scheduler, FILES["scheduler"])] if scheduler is not None else []),
            Entry("precision", strategy.precision, FILES["precision"]),
            Entry("callbacks", callbacks, FILES["callbacks"], check=lambda state: check_callback_states(callbacks, state)),
            Entry("trainer_state", loop, FILES["trainer_state"], per_rank=True),
            Entry("rng", RandomState(loop.state), FILES["rng"], per_rank=True),
        ]
        registry = cls(entries)
        for name, obj in user_states(states).items():
            registry.add(user_entry(name, obj))
        return registry

    def add(self, entry: Entry) -> None:
        """One more entry, written after the others; its name must be new."""
        if entry.name in self.entries:
            raise ConfigError(f"the checkpoint already has an entry {entry.name!r} ({self.entries[entry.name].file}): "
                              "give this state another name")
        self.entries[entry.name] = entry

    def __getitem__(self, name: str) -> Any:
        return self.entries[name].obj

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    # -- saving ---------------------------------------------------------------------------------
    def rank_states(self) -> dict[str, Any]:
        """This rank's part of every per-rank entry, to be gathered to the main rank."""
        return {e.name: e.obj.rank_state_dict() for e in self if e.per_rank}

    def write(self, writer: Any, full: bool, parts: list[dict[str, Any]]) -> None:
        """Main rank: each entry a checkpoint of this kind holds (``full``: the training state
        too) into its file; ``parts`` are every rank's ``rank_states()``."""
        for e in self:
            if e.training and not full:
                continue
            state = e.obj.state_dict([p[e.name] for p in parts]) if e.per_rank else e.obj.state_dict()
            if state is None and not e.required:
                continue
            if e.check is not None:
                e.check(state)
            if e.file.endswith(".json"):
                writer.write_json(e.file, state)
            else:
                writer.save_torch(e.file, state)

    # -- loading --------------------------------------------------------------------------------
    def read(self, path: Path, config: Any, rank: int, world_size: int) -> Loading:
        """Every restored entry's state as ``path`` holds it, before anything is restored: a
        required file that is absent is refused here, naming it."""
        saved: dict[str, Any] = {}
        for e in self:
            if not e.restore:
                continue
            file = path / e.file
            if file.is_file():
                saved[e.name] = _read(file, e)
            elif e.user:
                raise CheckpointError(
                    f"{path} holds no state {e.name!r} ({e.file}), which this fit names in states=: the run that "
                    f"wrote it had no such state. Resume without {e.name!r} in states=, or start a new fit from its "
                    f"weights (module.load_weights('{path}') before fit(), without resume)")
            elif e.required:
                raise CheckpointError(f"{path} has no {e.file} but this run has a {e.name} to restore from it")
        if rank == 0:
            self._warn_unnamed(path)
        return Loading(path, saved, config, rank, world_size)

    def _warn_unnamed(self, path: Path) -> None:
        files = {e.file for e in self}
        for p in sorted(path.iterdir()):
            m = USER_STATE_FILES.match(p.name)
            if m and p.name not in files:
                log.warning("%s holds state %r (%s), which this fit does not name in states=: it is not restored",
                            path.name, m.group(1), p.name)

    def check_resume(self, loading: Loading) -> None:
        """Each entry may refuse the checkpoint, before anything is restored."""
        for e in self:
            if e.restore and not e.user and hasattr(e.obj, "check_resume"):
                e.obj.check_resume(loading)

    def load(self, loading: Loading) -> None:
        """Restore every entry from what ``read`` gave, in order, then run each entry's
        post-load policy (``after_load``), in order."""
        for e in self:
            if e.restore and e.name in loading.saved:
                saved = loading.saved[e.name]
                if e.name == "scheduler":
                    check_scheduler_state(saved, loading.path / e.file)
                try:
                    e.obj.load_state_dict(*((saved, loading) if e.per_rank else (saved,)))
                except (TypeError, KeyError, AttributeError, IndexError, ValueError) as err:
                    # what a hand-edited file gives deep inside a load_state_dict: named by its file
                    raise CheckpointError(f"{loading.path / e.file} ({e.name}) could not be restored from what it "
                                          f"holds ({type(err).__name__}: {err}): is it as the run wrote it (edited "
                                          "by hand?)") from err
        for e in self:
            if e.restore and not e.user and hasattr(e.obj, "after_load"):
                e.obj.after_load(loading)


def check_scheduler_state(saved: Any, file: Path) -> None:
    """A learning-rate scheduler's state as ``state_dict`` writes it: a dict (a manual module's,
    ``{"schedulers": [state or None, ...]}``), whose step count ``last_epoch``, where it has one
    (torch's schedulers), is an integer >= 0. torch's ``load_state_dict`` takes any dict as it is."""
    many = isinstance(saved, dict) and "schedulers" in saved
    states = saved["schedulers"] if many else [saved]
    for state in states if isinstance(states, list) else [states]:
        if state is None and many:  # an optimizer without a scheduler
            continue
        last = state.get("last_epoch", 0) if isinstance(state, dict) else None
        if not (isinstance(last, int) and not isinstance(last, bool) and last >= 0):
            what = f"last_epoch is {last!r}" if isinstance(state, dict) else f"holds a {type(state).__name__}"
            raise CheckpointError(f"{file}: {what}, not a scheduler state with a step count >= 0 (edited by hand?); "
                                  "resume from another checkpoint")


def _read(file: Path, entry: Entry) -> Any:
    if file.suffix == ".json":
        return json.loads(file.read_text())
    try:
        return torch_load(file)
    except pickle.UnpicklingError as error:  # what torch.load(weights_only=True) refuses
        why = next((line for line in str(error).splitlines() if "WeightsUnpickler error" in line),
                   str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise CheckpointError(f"{file} ({entry.name}) holds what a resume does not load (checkpoints are read with "
                              f"torch.load(weights_only=True): tensors and plain Python values only): {why}") from None


# -- the user's states ------------------------------------------------------------------------------
def user_states(states: Mapping[str, Any] | None) -> dict[str, Any]:
    """``Fitter(states=...)`` checked: a mapping of names (letters, digits, ``_ . -``; not a
    built-in entry's) to objects with ``state_dict()`` and ``load_state_dict()``."""
    if states is None:
        return {}
    if not isinstance(states, Mapping):
        raise ConfigError(f"states= takes a dict of names to objects with state_dict()/load_state_dict() "
                          f"(states={{'ema': ema}}), not a {type(states).__name__}")
    for name, obj in states.items():
        if not isinstance(name, str) or not USER_STATE_NAME.match(name):
            raise ConfigError(f"states={{{name!r}: ...}}: a state's name must be a string of letters, digits, '_', "
                              "'.' and '-', starting with a letter or digit (it names its file, state-<name>.pt)")
        if name in BUILT_IN_NAMES:
            raise ConfigError(f"states={{{name!r}: ...}}: {name!r} is a built-in entry of every checkpoint "
                              f"({', '.join(BUILT_IN_NAMES)}); give your state another name")
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise ConfigError(f"states={{{name!r}: ...}}: a {type(obj).__name__} has no {' and no '.join(missing)}(); "
                              "a state is an object with state_dict() (tensors and plain Python values) and "
                              "load_state_dict(state), which every checkpoint saves and a resume restores")
    return dict(states)


def user_entry(name: str, obj: Any) -> Entry:
    """The entry of the user state ``name``: global (the main rank writes it, every rank loads
    it), training state (absent from weights-only checkpoints), required by a resume."""
    return Entry(name, obj, user_state_file(name), check=lambda state: check_loadable(
        state, lambda where: (f"states[{name!r}]", where)), user=True)


# -- states a resume could not load ---------------------------------------------------------------
def check_callback_states(callbacks: Any, states: Any) -> None:
    """``callbacks.pt`` (the callbacks' states, by ``state_key``) must load back as a resume
    loads it; the error names the callback."""
    def describe(where: list[Any]) -> tuple[str, list[Any]]:
        owner = next((type(cb).__name__ for cb in callbacks.callbacks if where and cb.state_key == where[0]), "?")
        return f"callback {owner}", where[1:]

    check_loadable(states, describe)


def check_loadable(state: Any, describe: Callable[[list[Any]], tuple[str, list[Any]]]) -> None:
    """Refuse, at a save, a state that would not load back as a resume loads it
    (``weights_only=True``): otherwise every checkpoint of the run would be written and verify,
    and only its resume would fail. ``describe(where)`` gives the owner's name and the path to
    show. Tensors are checked by type alone: their bytes are not serialised twice."""
    found = _unloadable(_skeleton(state))
    if found is None:
        return
    where, value = found
    owner, where = describe(where)
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise CheckpointError(
        f"{owner}: its state_dict(){''.join(f'[{k!r}]' for k in where)} holds a {kind} ({value!r:.60}), "
        "which a resume cannot load (checkpoints are read with torch.load(weights_only=True)), so no checkpoint "
        "of this run could be resumed: return plain Python values (float(x), int(x), x.item() for a numpy "
        "scalar, x.tolist() for an array), tensors, or lists, tuples and dicts of them from state_dict()")


def _skeleton(value: Any) -> Any:
    """``value`` with each plain tensor replaced by an empty one of its dtype, inside plain
    dicts, lists and tuples: it loads back exactly when ``value`` does, and costs no copy."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return torch.empty(0, dtype=value.dtype)
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((k, _skeleton(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _unloadable(state: Any) -> tuple[list[Any], Any] | None:
    """None if ``state`` loads back; else where the innermost value that does not is, and it."""
    if _loads_back(state):
        return None
    where: list[Any] = []
    value: Any = state
    while isinstance(value, (dict, list, tuple)):  # down to the innermost value that does not load back
        items = value.items() if isinstance(value, dict) else enumerate(value)
        bad = next(((k, v) for k, v in items if not _loads_back(v)), None)
        if bad is None:
            break  # the container itself (a namedtuple, say)
        where.append(bad[0])
        value = bad[1]
    return where, value


def _loads_back(obj: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)  # as a resume loads it
        return True
    except Exception:  # pickle.UnpicklingError names a type the loader refuses; any failure is one
        return False

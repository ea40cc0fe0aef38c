"""The files of a training checkpoint other than weights and optimizer state, as state objects:
``LoopState`` (``trainer_state.json``: the ``FitState``, the pending-loss buffer, the data
position) and ``RandomState`` (``rng.pt``). ``Checkpointer`` (``checkpointer.py``) writes them."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightlike.checkpoint.resume import best_checkpoint_name
from lightlike.errors import CheckpointError
from lightlike.pending import LossBuffer
from lightlike.state import FitState
from lightlike.utils.seed import rng_state, set_rng_state

log = logging.getLogger("lightlike")

#: who writes each checkpoint layout (the manifest's ``state_format``)
LAYOUTS = {"full": "a strategy that gathers the full state (single, ddp: model.safetensors + optimizer.pt)",
           "dcp": "FSDP (sharded, torch.distributed.checkpoint)", "deepspeed": "a DeepSpeed ZeRO strategy"}


class LoopState:
    """``trainer_state.json``: the loop's ``FitState``, each rank's losses not yet logged and
    batches taken in the epoch (the ranks' shares of an IterableDataset may differ by one), the
    logged totals, and the data order (seed, shuffle and the sampler's key), which the rest of an
    epoch must keep."""

    def __init__(self, state: FitState, losses: LossBuffer, train_data: Any):
        self.state, self.losses, self.train_data = state, losses, train_data
        #: ``len()`` of the training dataset (None: it has none), read once
        self.data_length = train_data.dataset_length() if train_data is not None else None

    def order_key(self) -> Any:
        return self.train_data.order_key() if self.train_data is not None else None

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part, gathered from every rank by the checkpointer."""
        return {"pending": self.losses.state_dict()["pending"], "batches_in_epoch": self.state.batches_in_epoch,
                "data_length": self.data_length}

    def state_dict(self, per_rank: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
        saved_state = self.state.state_dict()  # the best checkpoint by name: valid from any cwd
        saved_state["best_checkpoint"] = best_checkpoint_name(self.state.best_checkpoint)
        return {
            "state": saved_state,
            "world_size": world_size,
            "pending_per_rank": [r["pending"] for r in per_rank],
            "batches_in_epoch_per_rank": [r["batches_in_epoch"] for r in per_rank],
            "loss_total": [self.losses.loss_total, self.losses.items_total],
            "data_order": self.order_key(),
            "data_length_per_rank": [r["data_length"] for r in per_rank],
        }

    def load_state_dict(self, saved: dict[str, Any], path: Path, rank: int, world_size: int,
                        data_changed: str = "error") -> tuple[Any, Any]:
        """Restore from ``saved`` (read from ``path``); returns (the saved data order, this run's).
        Refuses a checkpoint taken mid-epoch whose data order this run would not continue, or
        whose training data had another length (unless ``data_changed='restart_epoch'``: the
        epoch then starts again, ``restarts_epoch``)."""
        state = self.state
        state.load_state_dict(saved["state"])
        per_rank = saved["batches_in_epoch_per_rank"]
        if len(per_rank) == world_size:  # this rank's own count
            state.batches_in_epoch = per_rank[rank]
        change = restarts_epoch(saved, path, self.data_length, rank, world_size, data_changed)
        if change:
            log.warning("resume_data_changed='restart_epoch': %s; epoch %d starts again from its start (its order "
                        "over the %d items: a function of seed and epoch), so the samples it had trained on are "
                        "trained on again", change, state.epoch_index, self.data_length)
            state.samples_in_epoch = state.batches_in_epoch = 0
            state.epoch = float(state.epoch_index)
        saved_order, order = saved["data_order"], self.order_key()
        if state.samples_in_epoch and saved_order != order:
            raise CheckpointError(
                f"{path.name} was taken mid-epoch with a data order of {saved_order} and this run's "
                f"gives {order}: the rest of the epoch would repeat and skip samples. Resume with the "
                "checkpoint's values (seed and shuffle; for an IterableDataset the same batch_size, num_workers and "
                "number of processes; LengthGroupedSampler(..., group_size=...)), or from a checkpoint taken at "
                "an epoch's end")
        self.losses.load_state_dict({"pending": pending_for_rank(saved["pending_per_rank"], rank, world_size),
                                     "totals": saved["loss_total"]})
        return saved_order, order


def restarts_epoch(saved: dict[str, Any], path: Path, length: int | None, rank: int, world_size: int,
                   policy: str) -> str | None:
    """What changed, when a resume from ``saved`` (``path``'s ``trainer_state.json``) must start
    its epoch again: taken mid-epoch on training data of another length than this run's
    (``length``); else None. The position (global samples into the epoch) would continue an
    order over other items, training again on samples the epoch has trained on and skipping
    others: refused (``CheckpointError``) unless ``policy`` is ``'restart_epoch'``. A checkpoint
    that predates the recorded length is refused only where its position is past this data's end."""
    fit = saved["state"]
    position, epoch = fit.get("samples_in_epoch", 0), fit.get("epoch_index", 0)
    if not position or length is None:
        return None
    lengths = saved.get("data_length_per_rank") or []  # a share per rank (differing) or the dataset's
    before = lengths[rank] if len(lengths) == world_size else lengths[0] if len(set(lengths)) == 1 else None
    if before == length or (before is None and position <= length):
        return None
    was = f"of {before} items" if before is not None else \
        "whose length it does not record (written by an earlier lightlike)"
    change = (f"{path.name} was taken {position} samples into epoch {epoch} of training data {was}, "
              f"and this run's has {length}")
    if policy == "restart_epoch":
        return change
    raise CheckpointError(
        f"{change}: the rest of that epoch would train again on samples it has trained on and skip others. "
        f"Resume with the checkpoint's training data, or set resume_data_changed='restart_epoch' (on the "
        f"command line --resume_data_changed restart_epoch) to start epoch {epoch} again from its start over "
        f"the {length} items")


def saved_fit_state(path: Path | None, train_data: Any, policy: str, rank: int) -> FitState | None:
    """The ``FitState`` saved at ``path`` as this run will continue it, read before anything is
    built (for the step budget): a restarted epoch (``restarts_epoch``) from its start, what it
    refuses refused here. None without a checkpoint, or for a weights-only one."""
    file = Path(path) / "trainer_state.json" if path is not None else None
    if file is None or not file.is_file():
        return None
    saved = json.loads(file.read_text())
    state = FitState.from_dict(saved["state"])
    if restarts_epoch(saved, Path(path), train_data.dataset_length(), rank, train_data.world_size, policy):
        state.samples_in_epoch = state.batches_in_epoch = 0
        state.max_steps = -1  # the epochs' steps are counted again from the restarted epoch's start
    return state


def pending_for_rank(per_rank: list[list[Any]], rank: int, world_size: int) -> list[Any]:
    """This rank's share of the losses the checkpoint's ranks had not logged yet: its own on the
    same world size (the next log sums them over ranks as the uninterrupted run did); on another,
    all of them on rank 0 and none elsewhere (the same sums)."""
    if len(per_rank) == world_size:
        return per_rank[rank]
    return [v for values in per_rank for v in values] if rank == 0 else []


class RandomState:
    """``rng.pt``: this process's random states (Python, numpy, torch, CUDA), numpy's arrays as
    lists so that they load with ``weights_only=True``."""

    def state_dict(self) -> dict[str, Any]:
        return _portable_rng(rng_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(_native_rng(state))

    def reseed(self, seed: int) -> None:
        """Streams derived afresh (a resume on another number of processes)."""
        torch.manual_seed(seed)


def torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def _loads_back(data: bytes) -> bool:
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # as a resume loads it
        return True
    except Exception:  # pickle.UnpicklingError names a type the loader refuses; any failure is one
        return False


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def callback_state_bytes(callbacks: Any) -> bytes:
    """``callbacks.pt``: the callbacks' states, checked to load back as a resume loads them
    (``weights_only=True``; they are small). A state that would not is refused here, at the first
    save, naming the callback and the value: otherwise every checkpoint of the run would be written
    and verify, and only its resume would fail."""
    states = callbacks.state_dict()
    data = _torch_bytes(states)
    if _loads_back(data):
        return data
    where: list[Any] = []
    value: Any = states
    while isinstance(value, (dict, list, tuple)):  # down to the innermost value that does not load back
        items = value.items() if isinstance(value, dict) else enumerate(value)
        bad = next(((k, v) for k, v in items if not _loads_back(_torch_bytes(v))), None)
        if bad is None:
            break  # the container itself (a namedtuple, say)
        where.append(bad[0])
        value = bad[1]
    owner = next((type(cb).__name__ for cb in callbacks.callbacks if where and cb.state_key == where[0]), "?")
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise CheckpointError(
        f"callback {owner}: its state_dict(){''.join(f'[{k!r}]' for k in where[1:])} holds a {kind} ({value!r:.60}), "
        "which a resume cannot load (checkpoints are read with torch.load(weights_only=True)), so no checkpoint "
        "of this run could be resumed: return plain Python values (float(x), int(x), x.item() for a numpy "
        "scalar, x.tolist() for an array), tensors, or lists, tuples and dicts of them from state_dict()")


def _portable_rng(state: dict[str, Any]) -> dict[str, Any]:
    """RNG state with numpy arrays as lists, loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss = state["python"]
    out = dict(state)
    out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    out["python"] = [version, list(internal), gauss]
    return out


def _native_rng(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    kind, keys, pos, has_gauss, cached = state["numpy"]
    out["numpy"] = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    version, internal, gauss = state["python"]
    out["python"] = (version, tuple(internal), gauss)
    return out


def jsonable(obj: Any) -> Any:
    """The module's hparams as JSON that rebuilds it: paths as their text, enums by value,
    sets (and tuples) as lists, inside lists and dicts too; anything else JSON has no form for
    as its repr (kept for a reader, not read back)."""
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        from lightlike.config import plain_value

        return {k: plain_value(v, leaf=lambda x: x if _is_json(x) else repr(x),
                               key=lambda k: k if isinstance(k, str) else str(k)) for k, v in obj.items()}


def _is_json(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False

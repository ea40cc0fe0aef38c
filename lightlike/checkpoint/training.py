"""The loop's registry entries (``registry.py``), each with its post-load policy:
``LoopState`` (``trainer_state.json``: the ``FitState``, the pending-loss buffer, the data
position; the best checkpoint chosen again), ``RandomState`` (``rng.pt``: every rank's random
state; streams derived afresh on another number of processes) and ``Hyperparameters``
(``hparams.json``, a record never loaded back)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightlike.best import greater_is_better, is_improvement, key_candidates
from lightlike.checkpoint.files import LAYOUTS, TRAINER_STATE_FILE
from lightlike.checkpoint.manifest import verify_checkpoint
from lightlike.checkpoint.resume import best_checkpoint_name, resolve_best
from lightlike.errors import CheckpointError, ConfigError
from lightlike.pending import LossBuffer
from lightlike.state import FitState
from lightlike.utils.seed import rng_state, set_rng_state

log = logging.getLogger("lightlike")

__all__ = ["LAYOUTS", "Hyperparameters", "LoopState", "RandomState", "check_trainer_state", "check_within_the_run", "jsonable", "saved_fit_state",
           "torch_load"]


class LoopState:
    """The ``trainer_state`` entry (per rank): the loop's ``FitState``, each rank's losses not yet
    logged and batches taken in the epoch (the ranks' shares of an IterableDataset may differ by
    one), the logged totals, and the data order (seed, shuffle and the sampler's key), which the
    rest of an epoch must keep. At a resume it refuses a checkpoint whose epoch this run cannot
    continue, and chooses the best checkpoint again when ``metric_for_best`` changed."""

    def __init__(self, state: FitState, losses: LossBuffer, train_data: Any):
        self.state, self.losses, self.train_data = state, losses, train_data
        #: ``len()`` of the training dataset (None: it has none), read once
        self.data_length = train_data.dataset_length() if train_data is not None else None
        self.restart: str | None = None  # why the resumed epoch starts again (check_resume), or None

    def order_key(self) -> Any:
        return self.train_data.order_key() if self.train_data is not None else None

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part, gathered from every rank by the checkpointer."""
        return {"pending": self.losses.state_dict()["pending"], "batches_in_epoch": self.state.batches_in_epoch,
                "data_length": self.data_length}

    def state_dict(self, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """``trainer_state.json``, from every rank's ``rank_state_dict()``."""
        saved_state = self.state.state_dict()  # the best checkpoint by name: valid from any cwd
        saved_state["best_checkpoint"] = best_checkpoint_name(self.state.best_checkpoint)
        return {
            "state": saved_state,
            "world_size": len(per_rank),
            "pending_per_rank": [r["pending"] for r in per_rank],
            "batches_in_epoch_per_rank": [r["batches_in_epoch"] for r in per_rank],
            "loss_total": [self.losses.loss_total, self.losses.items_total],
            "data_order": self.order_key(),
            "data_length_per_rank": [r["data_length"] for r in per_rank],
        }

    def check_resume(self, loading: Any) -> None:
        """Refuse a checkpoint taken mid-epoch whose data order this run would not continue, or
        whose training data had another length (unless ``resume_data_changed='restart_epoch'``:
        the epoch then starts again, ``restarts_epoch``)."""
        saved, path = loading.saved["trainer_state"], loading.path
        check_trainer_state(saved, path / TRAINER_STATE_FILE)
        self.restart = restarts_epoch(saved, path, self.data_length, loading.rank, loading.world_size,
                                      loading.config.resume_data_changed)
        position = 0 if self.restart else saved["state"].get("samples_in_epoch", 0)
        saved_order, order = saved["data_order"], self.order_key()
        continues = saved_order == order if self.train_data is None else self.train_data.continues(saved_order)
        if position and not continues:
            raise CheckpointError(
                f"{path.name} was taken mid-epoch with a data order of {saved_order} and this run's "
                f"gives {order}: the rest of the epoch would repeat and skip samples. Resume with the "
                "checkpoint's values (seed and shuffle; for an IterableDataset the same batch_size, num_workers and "
                "number of processes; LengthGroupedSampler(..., group_size=...)), or from a checkpoint taken at "
                "an epoch's end")

    def load_state_dict(self, saved: dict[str, Any], loading: Any) -> None:
        """Restore from ``saved``: this rank's own part on the checkpoint's number of processes;
        on another, the pending losses all on rank 0 (``pending_for_rank``)."""
        state, rank, world_size = self.state, loading.rank, loading.world_size
        state.load_state_dict(saved["state"])
        per_rank = saved["batches_in_epoch_per_rank"]
        if len(per_rank) == world_size:  # this rank's own count
            state.batches_in_epoch = per_rank[rank]
        if self.restart:
            log.warning("resume_data_changed='restart_epoch': %s; epoch %d starts again from its start (its order "
                        "over the %d items: a function of seed and epoch), so the samples it had trained on are "
                        "trained on again", self.restart, state.epoch_index, self.data_length)
            state.samples_in_epoch = state.batches_in_epoch = 0
            state.epoch = float(state.epoch_index)
        self.losses.load_state_dict({"pending": pending_for_rank(saved["pending_per_rank"], rank, world_size),
                                     "totals": saved["loss_total"]})

    def after_load(self, loading: Any) -> None:
        """The best checkpoint found again in this run's ``output_dir`` (by name), and chosen
        again if ``metric_for_best`` or its direction changed (``choose_best_again``)."""
        cfg, state = loading.config, self.state
        state.best_checkpoint = resolve_best(cfg.output_dir, state.best_checkpoint, state.best_step)
        choose_best_again(cfg, state, loading.saved.get("config"), loading.path)


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
    file = Path(path) / TRAINER_STATE_FILE if path is not None else None
    if file is None or not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text())
        check_trainer_state(saved, file)
    except (ValueError, CheckpointError) as e:  # (UnicodeDecodeError is a ValueError)
        verify_checkpoint(Path(path))  # read before the checkpoint is verified: a changed file is named as one
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file} is unreadable ({type(e).__name__}: {e})") from e
    state = FitState.from_dict(saved["state"])
    if restarts_epoch(saved, Path(path), train_data.dataset_length(), rank, train_data.world_size, policy):
        state.samples_in_epoch = state.batches_in_epoch = 0
        state.max_steps = -1  # the epochs' steps are counted again from the restarted epoch's start
    return state


def check_within_the_run(resumed: FitState | None, max_steps: int, path: Path | None, config: Any) -> None:
    """A resume from a checkpoint past this run's end (``max_steps``/``max_epochs`` lowered below
    where it stands) is one ``ConfigError`` before anything is built: nothing would train, and a
    fit that returns at once would read as done. A checkpoint at the end itself (a finished run,
    requeued) resumes and ends at once, with a line saying so."""
    if resumed is None or path is None:
        return
    by_epochs = config.max_steps is None and config.max_epochs is not None
    past = resumed.global_step > max_steps or (by_epochs and resumed.epoch > config.max_epochs + 1e-9)
    if not past and resumed.global_step < max_steps:
        return
    if not past:
        log.info("%s is at this run's last step (%d): nothing is left to train", Path(path).name, max_steps)
        return
    field = "max_steps" if config.max_steps is not None else "max_epochs"
    stands = resumed.global_step if field == "max_steps" else f"{resumed.epoch:g}"
    raise ConfigError(f"resume from {Path(path).name} (step {resumed.global_step}, epoch {resumed.epoch:g}) with "
                      f"{field}={getattr(config, field)!r}: the checkpoint is past this run's end "
                      f"({f'epoch {config.max_epochs:g}' if by_epochs else f'step {max_steps}'}), "
                      f"so nothing would train. Set {field} above {stands} to train on from it, or resume from an "
                      "earlier checkpoint", settings=(field,))


def check_trainer_state(saved: Any, file: Path) -> None:
    """``trainer_state.json`` as ``LoopState.state_dict`` writes it, or one ``CheckpointError``
    naming the file and the first field that is not (``FitState.check_saved`` for its state)."""
    def bad(name: str, value: Any, want: str) -> CheckpointError:
        return CheckpointError(f"{file}: {name} is {value!r}, not {want}: the file is not as lightlike writes it "
                               "(edited by hand?); resume from another checkpoint")

    if not isinstance(saved, dict):
        raise bad("the file's content", saved, "an object")
    if "state" not in saved:
        raise bad("state", None, "the fit's counters")
    FitState.check_saved(saved["state"], str(file))
    pending = saved.get("pending_per_rank")
    n = saved.get("world_size", len(pending) if isinstance(pending, list) else None)  # older files: no world_size
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise bad("world_size", n, "a number of processes >= 1")
    for key, each in (("pending_per_rank", lambda v: isinstance(v, list)),
                      ("batches_in_epoch_per_rank", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                      ("data_length_per_rank", lambda v: v is None or (isinstance(v, int) and v >= 0))):
        value = saved.get(key)
        if key == "data_length_per_rank" and value is None:
            continue  # written by an earlier lightlike: refused only where the data changed (restarts_epoch)
        if not (isinstance(value, list) and len(value) == n and all(each(v) for v in value)):
            raise bad(key, value, f"a list of {n} per-rank values")
    total = saved.get("loss_total")
    if not (isinstance(total, list) and len(total) == 2 and all(isinstance(v, (int, float)) for v in total)):
        raise bad("loss_total", total, "[loss sum, item sum]")


def pending_for_rank(per_rank: list[list[Any]], rank: int, world_size: int) -> list[Any]:
    """This rank's share of the losses the checkpoint's ranks had not logged yet: its own on the
    same world size (the next log sums them over ranks as the uninterrupted run did); on another,
    all of them on rank 0 and none elsewhere (the same sums)."""
    if len(per_rank) == world_size:
        return per_rank[rank]
    return [v for values in per_rank for v in values] if rank == 0 else []


class RandomState:
    """The ``rng`` entry (per rank): this process's random states (Python, numpy, torch, CUDA),
    numpy's arrays as lists so that they load with ``weights_only=True``. A resume on another
    number of processes derives the streams afresh from the seed, rank and step, with a warning."""

    def __init__(self, state: FitState):
        self.state = state  # the loop's: restored before this entry (the step a new stream starts from)

    def rank_state_dict(self) -> dict[str, Any]:
        return _portable_rng(rng_state())

    def state_dict(self, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``rng.pt``: every rank's random state, in rank order."""
        return list(per_rank)

    def load_state_dict(self, per_rank: list[dict[str, Any]], loading: Any) -> None:
        if len(per_rank) == loading.world_size:
            set_rng_state(_native_rng(per_rank[loading.rank]))
            return
        log.warning("resuming a run saved on %s process(es) on %s: data position is kept (in global "
                    "samples) but RNG streams are re-derived, so this is not a bit-exact continuation",
                    len(per_rank), loading.world_size)
        torch.manual_seed(loading.config.seed + 7919 * (loading.rank + 1) + self.state.global_step)


class Hyperparameters:
    """The ``hparams`` entry: the module's ``save_hyperparameters()`` record as JSON (None, and
    no file, when it recorded none), for the command line and exports; never loaded back."""

    def __init__(self, module: Any):
        self.module = module

    def state_dict(self) -> Any:
        hparams = getattr(self.module, "hparams", None)
        return jsonable(hparams) if hparams else None

    def load_state_dict(self, state: Any) -> None:
        pass


def torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


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


def choose_best_again(cfg: Any, state: FitState, old: dict[str, Any] | None, path: Path) -> None:
    """``metric_for_best`` or its direction changed since ``path`` was saved (with the settings
    ``old``): the restored best (a value of the old metric, or the old direction's best) would be
    compared with the new metric's values. The best so far is chosen again from the evaluations in
    the log history under this run's setting; its checkpoint is the one saved at that step, if it
    is still there."""
    if old is None:
        return
    old_key, key = old.get("metric_for_best"), cfg.metric_for_best
    old_way = greater_is_better(old_key, old.get("greater_is_better")) if old_key else None
    way = greater_is_better(key, cfg.greater_is_better) if key else None
    if (old_key, old_way) == (key, way):
        return
    state.best_metric = state.best_step = state.best_checkpoint = None
    if key is not None:
        for row in state.log_history:
            # a set-less key ("accuracy"): the one evaluation metric it names (training rows' keys are train/...)
            found = key_candidates(key, (k for k in row if k != "step" and not k.startswith("train/")))
            if len(found) == 1 and is_improvement(row[found[0]], state.best_metric, bool(way)):
                state.best_metric, state.best_step = row[found[0]], int(row["step"])
        if state.best_step is not None:
            state.best_checkpoint = resolve_best(cfg.output_dir, f"checkpoint-{state.best_step}", state.best_step)
    if key is None:
        chosen = "none is tracked"
    elif state.best_step is None:
        chosen = "no evaluation logged so far has it"
    else:
        kept = Path(state.best_checkpoint).name if state.best_checkpoint else "none kept at that step"
        chosen = f"step {state.best_step} ({key}={state.best_metric:.6g}, checkpoint: {kept})"
    log.warning("metric_for_best changed since %s: %s -> %s; the best so far is chosen again from the logged "
                "evaluations: %s. Checkpoints the earlier run kept or rotated by its own best stay as they are",
                path.name, _direction(old_key, old_way), _direction(key, way), chosen)


def _direction(key: str | None, greater: bool | None) -> str:
    return "none" if key is None else f"{key} ({'higher' if greater else 'lower'} is better)"

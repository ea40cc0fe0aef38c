"""What a training checkpoint holds, and putting a ``Fitter`` back where it was.

Layout of ``output_dir/checkpoint-{step}/`` (every file listed with size and CRC-32 in
``manifest.json``, which is written last; see ``atomic.py``)::

    model.safetensors     full weights (strategies that shard write their own files instead;
                          the manifest's meta names the layout: ``state_format``)
    hparams.json          the module's hyperparameters, when it recorded any
    config.json           the FitConfig of the run
    optimizer.pt          optimizer state          \
    scheduler.pt          LR scheduler state        |
    precision.pt          GradScaler state          |  absent with save_only_model=True
    rng.pt                RNG states, one per rank  |  (such a checkpoint cannot be resumed)
    trainer_state.json    FitState + data position + pending loss values
    callbacks.pt          callback states (EarlyStopping counters, ...)  /
"""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightlike.checkpoint.atomic import CheckpointWriter
from lightlike.checkpoint.manifest import verify_checkpoint
from lightlike.checkpoint.resume import (
    CONTINUATION_KEYS,
    apply_changed_settings,
    best_checkpoint_name,
    check_optimizer_fits,
    choose_best_again,
    resolve_best,
    resolve_resume,
    tidy_output_dir,
)
from lightlike.checkpoint.rotation import rotate_checkpoints
from lightlike.errors import CheckpointError
from lightlike.state import FitState
from lightlike.utils.seed import rng_state, set_rng_state

if TYPE_CHECKING:
    from lightlike.fitter import Fitter

log = logging.getLogger("lightlike")


def save_training_checkpoint(fitter: Fitter, wait: bool = True, full: bool | None = None) -> Path | None:
    """Write ``checkpoint-{global_step}`` atomically, then rotate. Collective: every rank calls
    it and writes into the main rank's temp directory what its Strategy shards there (nothing,
    for strategies that gather); the main rank writes the rest and commits once every rank is
    done. Returns the path on the main rank, None elsewhere.

    ``wait=False`` with ``async_save=True`` (the Fitter's periodic saves): a strategy that
    shards (FSDP) stages its state to CPU memory and writes it in the background, committed by
    ``commit_pending_checkpoint`` at the next save or at the end of the fit; a strategy that
    gathers writes its files here, then the main rank fsyncs, hashes and writes the manifest in
    a background thread, and renames it when committing. Either way the checkpoint is invisible
    until committed, just before its ``on_save``: a kill in between leaves the previous
    checkpoint as the newest valid one.

    ``full=True`` writes a full, resumable checkpoint even with ``save_only_model=True`` (a
    preemption save: the requeued job must be able to resume); ``full=False`` weights only;
    None (the default) follows ``save_only_model``. Every rank must pass the same value."""
    commit_pending_checkpoint(fitter)
    cfg, strategy, state = fitter.config, fitter.strategy, fitter.state
    assert strategy is not None and fitter.optimizer is not None
    step = state.global_step
    out = Path(cfg.output_dir)
    final = out / f"checkpoint-{step}"
    if state.best_step == step:
        state.best_checkpoint = str(final)
    elif resolve_best(out, state.best_checkpoint, state.best_step) is None:
        state.best_checkpoint = None  # the best step has no checkpoint: never point at another one
    state.last_save_step = step
    full = (not cfg.save_only_model) if full is None else bool(full)
    main = strategy.is_global_zero
    meta = {"kind": "full" if full else "model", "state_format": strategy.checkpoint_format}
    writer = CheckpointWriter(out, step, meta=meta, overwrite=True)
    if strategy.world_size > 1:
        writer = CheckpointWriter(out, step, meta=meta, overwrite=True,
                                  tmp_name=strategy.collectives.broadcast_object(writer.tmp.name))
    if main:
        writer.__enter__()  # creates the temp directory
    strategy.collectives.barrier("save")  # ... before any rank writes into it
    try:
        pending = strategy.save_checkpoint_state(writer, fitter.model, fitter.optimizer if full else None)
        # every rank's RNG state, not-yet-logged losses (the next log sums all ranks' items) and
        # batches taken in the epoch (the ranks' shares of an IterableDataset may differ by one)
        per_rank = strategy.collectives.all_gather_object((_portable_rng(rng_state()), _pending_values(fitter),
                                               state.batches_in_epoch)) if full else []
        rng_all = [r for r, _, _ in per_rank]
        if main:
            if getattr(fitter.module, "hparams", None):
                writer.write_json("hparams.json", _jsonable(fitter.module.hparams))  # type: ignore[union-attr]
            writer.write_json("config.json", cfg.to_dict())
            if full:
                if fitter.scheduler is not None:
                    writer.save_torch("scheduler.pt", fitter.scheduler.state_dict())
                writer.save_torch("precision.pt", strategy.precision.state_dict())
                writer.save_torch("rng.pt", rng_all)
                writer.write_bytes("callbacks.pt", _resumable_callback_states(fitter))
                saved_state = state.to_dict()  # the best checkpoint by name: valid from any cwd
                saved_state["best_checkpoint"] = best_checkpoint_name(state.best_checkpoint)
                writer.write_json("trainer_state.json", {
                    "state": saved_state,
                    "world_size": strategy.world_size,
                    "pending_per_rank": [p for _, p, _ in per_rank],
                    "batches_in_epoch_per_rank": [b for _, _, b in per_rank],
                    "loss_total": [fitter._loss_total, fitter._items_total],
                    "data_order": _order_key(fitter),
                })
        if pending is not None and not wait:
            fitter._checkpoint_in_flight = (writer, pending, None)
            return None
        if pending is not None:
            pending.result()
        strategy.collectives.barrier("save")  # every rank's files are written
    except BaseException:
        if main:
            writer.__exit__(*sys.exc_info())  # removes the temp directory
        raise
    if not wait and cfg.async_save:
        committing = None
        if main:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightlike-commit")
            committing = pool.submit(writer.seal)  # fsync, hash, manifest; renamed when committed
            pool.shutdown(wait=False)
        fitter._checkpoint_in_flight = (writer, None, committing)
        return None
    return _commit(fitter, writer)


def commit_pending_checkpoint(fitter: Fitter) -> Path | None:
    """Wait for an asynchronous checkpoint write to finish on every rank, then commit it.
    Collective; a no-op when nothing is in flight. Returns the committed path (every rank)."""
    in_flight = getattr(fitter, "_checkpoint_in_flight", None)
    if in_flight is None:
        return None
    fitter._checkpoint_in_flight = None
    writer, pending, committing = in_flight
    if pending is not None:
        try:
            pending.result()  # this rank's shards are on disk
            fitter.strategy.collectives.barrier("save")  # type: ignore[union-attr]  # ... and every rank's
        except BaseException:
            if fitter.strategy.is_global_zero:  # type: ignore[union-attr]
                writer.__exit__(*sys.exc_info())
            raise
    return _commit(fitter, writer, committing)


def publish_sealed_checkpoint(fitter: Fitter) -> Path | None:
    """On the way out of a fit that failed: an asynchronous checkpoint that every rank had
    written before it failed, being sealed in the background (single, DDP), is complete: the
    main rank waits for the seal and gives it its name, alone (the other ranks may be gone), with
    no ``on_save`` (the fit is failing). A sharded one still being written (FSDP) is left; its
    temp directory goes at the next start. Returns the path where one was published."""
    in_flight = getattr(fitter, "_checkpoint_in_flight", None)
    fitter._checkpoint_in_flight = None
    if in_flight is None or in_flight[1] is not None or in_flight[2] is None:
        return None
    writer, _, committing = in_flight
    try:
        committing.result()
        writer.publish()
    except Exception as e:  # the fit's own error is the one to raise
        log.warning("the checkpoint %s written before the failure could not be committed: %s", writer.final_path, e)
        return None
    log.warning("committed %s, written before the fit failed", writer.final_path)
    return writer.final_path


def rotate(fitter: Fitter, keep_resume_source: bool = False) -> None:
    """Main rank: delete the oldest checkpoints past ``save_total_limit``, never the best one. The
    checkpoint this run resumed from needs no protection otherwise: rotation runs only after this
    run has committed a newer one, so a later resume has that (the newest is kept);
    ``keep_resume_source`` keeps it while an out-of-memory retry may start from it again."""
    cfg, state = fitter.config, fitter.state
    protect = [state.best_checkpoint] if state.best_checkpoint else []
    if keep_resume_source and fitter.resumed_from:
        protect.append(fitter.resumed_from)
    for p in rotate_checkpoints(cfg.output_dir, cfg.save_total_limit, protect=protect):
        log.info("deleted old checkpoint %s (save_total_limit=%s)", p, cfg.save_total_limit)


def _commit(fitter: Fitter, writer: CheckpointWriter, committing: Any = None) -> Path:
    """Commit on the main rank (or wait for the background commit), then rotate. Returns the
    committed path on every rank (``on_save`` runs everywhere, as every callback event does)."""
    cfg, strategy = fitter.config, fitter.strategy
    assert strategy is not None
    path = writer.final_path
    if strategy.is_global_zero:
        if committing is not None:
            committing.result()  # raises what sealing it raised
            writer.publish()  # visible from now on, as on_save says
        else:
            writer.__exit__(None, None, None)  # fsync, hash, manifest, rename
        rotate(fitter, keep_resume_source=cfg.auto_find_batch_size)  # a retry starts from it again
        log.info("saved checkpoint %s", path)
    strategy.collectives.barrier("save")
    return path


#: who writes each checkpoint layout (the manifest's ``state_format``)
LAYOUTS = {"full": "a strategy that gathers the full state (single, ddp: model.safetensors + optimizer.pt)",
           "dcp": "FSDP (sharded, torch.distributed.checkpoint)", "deepspeed": "a DeepSpeed ZeRO strategy"}


def load_training_checkpoint(fitter: Fitter, path: Path, verified: bool = False) -> None:
    """Restore weights, optimizer, scheduler, precision, RNG, FitState, callbacks and the
    data position from ``path``, verified first: in full, or by sizes only when ``verified``
    (``resume=True`` has just checksummed it to choose it; a second pass would double the wait).
    Collective. Once loaded, the main rank tidies ``output_dir`` (``resume.tidy_output_dir``:
    stale temp directories removed, newer checkpoints of an abandoned continuation moved aside);
    the barrier first makes sure no rank is still looking for the checkpoint to resume from."""
    cfg, strategy = fitter.config, fitter.strategy
    assert strategy is not None and fitter.optimizer is not None
    strategy.collectives.barrier("resume")
    manifest = verify_checkpoint(path, hashes=cfg.verify_hashes and not verified)
    if manifest.get("meta", {}).get("kind") == "model" or not (path / "trainer_state.json").exists():
        raise CheckpointError(
            f"{path} holds weights only (saved with save_only_model=True) and cannot be resumed; "
            "load its weights with module.load_weights(path) and start a new fit"
        )
    layout = manifest.get("meta", {}).get("state_format", "full")
    if layout not in strategy.resumes_from:  # its optimizer state cannot be restored here
        raise CheckpointError(
            f"{path} was written by {LAYOUTS.get(layout, repr(layout))}, and the {strategy.name} strategy cannot "
            f"restore its optimizer state: resume it with the strategy that wrote it, or start a new fit from its "
            "weights: " + ("module.load_weights(path) before fit()" if (path / "model.safetensors").is_file() else
                           f"`lightlike export {path} OUT_DIR`, then module.load_weights(OUT_DIR) before fit()"))
    check_optimizer_fits(fitter, path)
    strategy.load_checkpoint_state(path, fitter.model, fitter.optimizer)
    if fitter.scheduler is not None:
        if not (path / "scheduler.pt").exists():
            raise CheckpointError(f"{path} has no scheduler.pt but this run has a scheduler")
        fitter.scheduler.load_state_dict(_torch_load(path / "scheduler.pt"))
    strategy.precision.load_state_dict(_torch_load(path / "precision.pt"))
    fitter.callbacks.load_state_dict(_torch_load(path / "callbacks.pt"))
    saved = json.loads((path / "trainer_state.json").read_text())
    fitter.state = state = FitState.from_dict(saved["state"])
    if len(saved.get("batches_in_epoch_per_rank", [])) == strategy.world_size:  # this rank's own count
        state.batches_in_epoch = saved["batches_in_epoch_per_rank"][strategy.global_rank]
    state.best_checkpoint = resolve_best(cfg.output_dir, state.best_checkpoint, state.best_step)
    choose_best_again(fitter, path)  # metric_for_best or greater_is_better changed
    # mid-epoch, the rest of the epoch must be the same order's: "data_order" (seed, shuffle and
    # the sampler's own key), or in checkpoints of earlier versions "order_key" (the sampler's own)
    saved_order, order = saved.get("data_order"), _order_key(fitter)
    if "data_order" not in saved and "order_key" in saved:
        saved_order = saved["order_key"]
        order = fitter.train_data.sampler.order_key() if fitter.train_data and fitter.train_data.sampler else None
    if state.samples_in_epoch and ("data_order" in saved or "order_key" in saved) and saved_order != order:
        raise CheckpointError(
            f"{path.name} was taken mid-epoch with a data order of {saved_order} and this run's "
            f"gives {order}: the rest of the epoch would repeat and skip samples. Resume with the "
            "checkpoint's values (seed and shuffle; for an IterableDataset the same batch_size, num_workers and "
            "number of processes; LengthGroupedSampler(..., group_size=...)), or from a checkpoint taken at "
            "an epoch's end")
    fitter._pending = [(torch.tensor(loss, dtype=torch.float64, device=strategy.root_device), n, int(step), int(micro))  # type: ignore[misc]
                       for loss, n, step, micro in _pending_for_this_rank(saved, strategy.global_rank, strategy.world_size)]
    fitter._loss_total, fitter._items_total = saved.get("loss_total", [0.0, 0.0])
    rngs = _torch_load(path / "rng.pt")
    rank = strategy.global_rank
    if saved.get("world_size", 1) != strategy.world_size:
        log.warning("resuming a run saved on %s process(es) on %s: data position is kept (in global "
                    "samples) but RNG streams are re-derived, so this is not a bit-exact continuation",
                    saved.get("world_size"), strategy.world_size)
        torch.manual_seed(cfg.seed + 7919 * (rank + 1) + state.global_step)
    else:
        set_rng_state(_native_rng(rngs[rank]))
    apply_changed_settings(fitter, path, (saved.get("data_order"), order))  # (none in earlier versions)
    fitter.resumed_from = str(path)
    if strategy.is_global_zero:
        tidy_output_dir(cfg.output_dir, state.global_step, path)
    log.info("resumed from %s at step %d (epoch %d, %d samples into it)", path, state.global_step,
             state.epoch_index, state.samples_in_epoch)


def load_weights_from(fitter: Fitter, path: Path) -> None:
    """Load only the weights of a checkpoint (``load_best_at_end``): the one saved at the best
    step, or none (with a warning, and ``best_checkpoint`` cleared) if ``path`` is another."""
    assert fitter.strategy is not None
    state = fitter.state
    if resolve_best(path.parent, str(path), state.best_step) is None:
        log.warning("load_best_at_end: the best evaluation (step %s) has no checkpoint of its own (%s is "
                    "another step's); keeping the final weights. Save at every evaluation step (save_every "
                    "a multiple of eval_every) to load the best", state.best_step, path.name)
        state.best_checkpoint = None
        return
    verify_checkpoint(path, hashes=fitter.config.verify_hashes)
    fitter.strategy.load_checkpoint_state(path, fitter.model, None)
    log.info("loaded the best checkpoint's weights from %s", path)


def _pending_values(fitter: Fitter) -> list[list[float]]:
    """This rank's not-yet-logged (loss, items, step, micro-batch) values, on the host: they go
    into checkpoints so the first log after a resume averages what the uninterrupted run would."""
    return [list(v) for v in fitter._read_pending()]


def _pending_for_this_rank(saved: dict[str, Any], rank: int, world_size: int) -> list[list[float]]:
    """This rank's share of the losses the checkpoint's ranks had not logged yet: its own on the
    same world size (the next log sums them over ranks as the uninterrupted run did); on another,
    all of them on rank 0 and none elsewhere (the same sums). A checkpoint of an older version
    kept rank 0's only ("pending")."""
    per_rank = saved.get("pending_per_rank")
    if per_rank is None:
        return saved.get("pending", []) if rank == 0 else []
    if len(per_rank) == world_size:
        return per_rank[rank]
    return [v for values in per_rank for v in values] if rank == 0 else []


def _order_key(fitter: Fitter) -> Any:
    return fitter.train_data.order_key() if fitter.train_data is not None else None


def _torch_load(path: Path) -> Any:
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


def _resumable_callback_states(fitter: Fitter) -> bytes:
    """``callbacks.pt``: the callbacks' states, checked to load back as a resume loads them
    (``weights_only=True``; they are small). A state that would not is refused here, at the first
    save, naming the callback and the value: otherwise every checkpoint of the run would be written
    and verify, and only its resume would fail."""
    states = fitter.callbacks.state_dict()
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
    owner = next((type(cb).__name__ for cb in fitter.callbacks.callbacks if where and cb.state_key == where[0]), "?")
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


def _jsonable(obj: Any) -> Any:
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


__all__ = ["CONTINUATION_KEYS", "load_training_checkpoint", "load_weights_from", "resolve_resume",
           "save_training_checkpoint"]

"""``Checkpointer``: the one owner of what a training checkpoint holds.

Layout of ``output_dir/checkpoint-{step}/`` (every file listed with size and checksum in
``manifest.json``, which is written last; see ``atomic.py``)::

    model.safetensors     full weights (strategies that shard write their own files instead;
                          the manifest's meta names the layout: ``state_format``)
    hparams.json          the module's hyperparameters, when it recorded any
    config.json           the FitConfig of the run
    optimizer.pt          optimizer state          \\
    scheduler.pt          LR scheduler state        |
    precision.pt          GradScaler state          |  absent with save_only_model=True
    rng.pt                RNG states, one per rank  |  (such a checkpoint cannot be resumed)
    trainer_state.json    FitState + data position + pending loss values
    callbacks.pt          callback states (EarlyStopping counters, ...)  /

It is built with explicit state objects, each with ``state_dict``/``load_state_dict``: the
weights and optimizer state (written by the strategy, which knows their layout), the scheduler,
the precision plugin, the callbacks, the random state, and the loop's own (``LoopState``: the
``FitState``, the pending-loss buffer and the data position). It owns the asynchronous write in
flight. The Fitter, preemption, the out-of-memory retry and fail-fast call its public methods.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightlike.checkpoint.atomic import CheckpointWriter, not_saved_error, set_aside_in_the_way
from lightlike.checkpoint.manifest import list_checkpoints, verify_checkpoint
from lightlike.checkpoint.resume import (
    apply_changed_settings,
    check_optimizer_fits,
    choose_best_again,
    resolve_best,
    tidy_output_dir,
)
from lightlike.checkpoint.rotation import rotate_checkpoints
from lightlike.checkpoint.training import (
    LAYOUTS,
    LoopState,
    RandomState,
    callback_state_bytes,
    jsonable,
    torch_load,
)
from lightlike.config import FitConfig
from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")


class Checkpointer:
    """Saves and loads this fit's training checkpoints. Every method that writes or reads is
    collective: every rank calls it at the same point."""

    def __init__(self, config: FitConfig, strategy: Any, *, module: Any, model: Any, optimizer: Any,
                 scheduler: Any, callbacks: Any, loop: LoopState):
        self.config, self.strategy = config, strategy
        self.module, self.model, self.optimizer, self.scheduler = module, model, optimizer, scheduler
        self.callbacks, self.loop, self.rng = callbacks, loop, RandomState()
        self.in_flight: tuple[CheckpointWriter, Any, Any] | None = None  # (writer, shards' future, seal's future)
        self.resumed_from: str | None = None
        self.written: set[Path] = set()  # the checkpoints this fit committed: the only ones a save replaces
        self.latest: Path | None = None  # the checkpoint last committed or resumed from

    # -- saving ---------------------------------------------------------------------------------
    def save(self, wait: bool = True, full: bool | None = None) -> Path | None:
        """Write ``checkpoint-{global_step}`` atomically, then rotate. Every rank writes into the
        main rank's temp directory what its strategy shards there (nothing, for strategies that
        gather); the main rank writes the rest and commits once every rank is done. Returns the
        path (every rank), or None while an asynchronous write is in flight.

        ``wait=False`` with ``async_save=True``: a strategy that shards (FSDP) stages its state
        to CPU memory and writes it in the background; one that gathers writes its files here,
        then the main rank fsyncs, hashes and writes the manifest in a background thread. Either
        way the checkpoint is invisible until ``commit`` (at the next save or the end of the fit):
        a kill in between leaves the previous checkpoint as the newest valid one.

        ``full=True`` writes a resumable checkpoint even with ``save_only_model=True`` (a
        preemption save); ``full=False`` weights only; None follows ``save_only_model``."""
        self.commit()
        with self._named_disk_errors(self.loop.state.global_step):
            return self._save(wait, full)

    def _save(self, wait: bool, full: bool | None) -> Path | None:
        cfg, strategy, state = self.config, self.strategy, self.loop.state
        out, step = Path(cfg.output_dir), state.global_step
        if state.best_step == step:
            state.best_checkpoint = str(out / f"checkpoint-{step}")
        elif resolve_best(out, state.best_checkpoint, state.best_step) is None:
            state.best_checkpoint = None  # the best step has no checkpoint: never point at another one
        state.last_save_step = step
        full = (not cfg.save_only_model) if full is None else bool(full)
        writer = self._writer(out, step, full)
        try:
            shards = strategy.save_checkpoint_state(writer, self.model, self.optimizer if full else None)
            # every rank's random state and loop state (pending losses, batches taken in the epoch)
            per_rank = strategy.collectives.all_gather_object((self.rng.state_dict(), self.loop.rank_state_dict())) \
                if full else []
            if strategy.is_global_zero:
                self._write_main_files(writer, full, per_rank)
            if shards is not None and not wait:
                self.in_flight = (writer, shards, None)
                return None
            if shards is not None:
                shards.result()
            strategy.collectives.barrier("save")  # every rank's files are written
        except BaseException:
            if strategy.is_global_zero:
                writer.__exit__(*sys.exc_info())  # removes the temp directory
            raise
        if not wait and cfg.async_save:
            self.in_flight = (writer, None, self._seal_in_background(writer))
            return None
        return self._commit(writer)

    def _writer(self, out: Path, step: int, full: bool) -> CheckpointWriter:
        """The writer of this save, its temp directory made by the main rank and named for all."""
        strategy = self.strategy
        meta = {"kind": "full" if full else "model", "state_format": strategy.checkpoint_format}
        # this fit's own checkpoint-N (a preemption's full save over this step's weights-only one) is
        # replaced; anything else under the name is moved aside, never deleted
        own = (out / f"checkpoint-{step}") in self.written
        writer = CheckpointWriter(out, step, meta=meta, overwrite=own)
        if strategy.world_size > 1:
            writer = CheckpointWriter(out, step, meta=meta, overwrite=own,
                                      tmp_name=strategy.collectives.broadcast_object(writer.tmp.name))
        if strategy.is_global_zero:
            if not own and (writer.final_path.exists() or writer.final_path.is_symlink()):
                set_aside_in_the_way(out, [writer.final_path])
            writer.__enter__()  # creates the temp directory
        strategy.collectives.barrier("save")  # ... before any rank writes into it
        return writer

    def _write_main_files(self, writer: CheckpointWriter, full: bool, per_rank: list[Any]) -> None:
        hparams = getattr(self.module, "hparams", None)
        if hparams:
            writer.write_json("hparams.json", jsonable(hparams))
        writer.write_json("config.json", self.config.to_dict())
        if not full:
            return
        if self.scheduler is not None:
            writer.save_torch("scheduler.pt", self.scheduler.state_dict())
        writer.save_torch("precision.pt", self.strategy.precision.state_dict())
        writer.save_torch("rng.pt", [rng for rng, _ in per_rank])
        writer.write_bytes("callbacks.pt", callback_state_bytes(self.callbacks))
        writer.write_json("trainer_state.json", self.loop.state_dict([loop for _, loop in per_rank],
                                                                     self.strategy.world_size))

    def _seal_in_background(self, writer: CheckpointWriter) -> Any:
        """Main rank: fsync, hash and write the manifest in a thread (renamed at ``commit``)."""
        if not self.strategy.is_global_zero:
            return None
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightlike-commit")
        sealing = pool.submit(writer.seal)
        pool.shutdown(wait=False)
        return sealing

    def commit(self) -> Path | None:
        """Wait for the asynchronous write in flight on every rank, then commit it. A no-op when
        nothing is in flight. Returns the committed path (every rank)."""
        if self.in_flight is None:
            return None
        (writer, shards, sealing), self.in_flight = self.in_flight, None
        if shards is not None:
            try:
                with self._named_disk_errors(writer.step):
                    shards.result()  # this rank's shards are on disk
                self.strategy.collectives.barrier("save")  # ... and every rank's
            except BaseException:
                if self.strategy.is_global_zero:
                    writer.__exit__(*sys.exc_info())
                raise
        return self._commit(writer, sealing)

    def _commit(self, writer: CheckpointWriter, sealing: Any = None) -> Path:
        """Commit on the main rank (or wait for the background seal), then rotate."""
        strategy, path = self.strategy, writer.final_path
        if strategy.is_global_zero:
            with self._named_disk_errors(writer.step):
                if sealing is not None:
                    sealing.result()  # raises what sealing it raised
                    writer.publish()
                else:
                    writer.__exit__(None, None, None)  # fsync, hash, manifest, rename
            self.written.add(path)
            self.rotate(keep_resume_source=self.config.auto_find_batch_size)  # a retry starts from it again
            log.info("saved checkpoint %s", path)
        strategy.collectives.barrier("save")
        self.latest = path
        return path

    def final_checkpoint(self) -> str | None:
        """The checkpoint holding the fit's final weights: the one of its last step, committed by
        this fit or resumed from; None when that step has none (``save_strategy='no'``)."""
        state = self.loop.state
        if self.latest is None or state.last_save_step != state.global_step:
            return None
        return str(self.latest)

    @contextlib.contextmanager
    def _named_disk_errors(self, step: int) -> Iterator[None]:
        """A save that ran out of room (ENOSPC, EDQUOT, EFBIG, wherever in the error's chain)
        raises one ``CheckpointError`` saying so; the writer has removed its temp directory."""
        try:
            yield
        except Exception as error:
            if isinstance(error, CheckpointError):  # said already (a commit inside a save)
                raise
            problem = not_saved_error(error, self.config.output_dir, step, self.size_estimate())
            if problem is None:
                raise
            raise problem from error

    def size_estimate(self) -> int | None:
        """About what a checkpoint of this fit takes: the newest committed one's files, or else
        the bytes of the module's and the optimizer's tensors (None if neither can be read)."""
        try:
            newest = list_checkpoints(self.config.output_dir)[-1:]
            if newest:
                return sum(info["size"] for info in verify_checkpoint(newest[0], hashes=False)["files"].values())
            # parameters and optimizer state as they are (a state_dict() may be a collective)
            state = getattr(self.optimizer, "state", {})
            tensors = [*self.module.parameters(), *(v for s in state.values() for v in s.values())]
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        except Exception:  # an estimate for a message: never a second error
            return None

    def publish_sealed(self) -> Path | None:
        """On the way out of a fit that failed: an asynchronous checkpoint that every rank had
        written before the failure, being sealed in the background (single, DDP), is complete:
        the main rank waits for the seal and gives it its name, alone (the other ranks may be
        gone). A sharded one still being written (FSDP) is left; its temp directory goes at the
        next start. Returns the path where one was published."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None or in_flight[1] is not None or in_flight[2] is None:
            return None
        writer, _, sealing = in_flight
        try:
            sealing.result()
            writer.publish()
        except Exception as e:  # the fit's own error is the one to raise
            log.warning("the checkpoint %s written before the failure could not be committed: %s", writer.final_path, e)
            return None
        log.warning("committed %s, written before the fit failed", writer.final_path)
        return writer.final_path

    def rotate(self, keep_resume_source: bool = False) -> None:
        """Main rank: delete the oldest checkpoints past ``save_total_limit``, never the best one;
        ``keep_resume_source`` keeps the one this fit resumed from (an out-of-memory retry starts
        from it again)."""
        cfg, state = self.config, self.loop.state
        protect = [state.best_checkpoint] if state.best_checkpoint else []
        if keep_resume_source and self.resumed_from:
            protect.append(self.resumed_from)
        for p in rotate_checkpoints(cfg.output_dir, cfg.save_total_limit, protect=protect):
            log.info("deleted old checkpoint %s (save_total_limit=%s)", p, cfg.save_total_limit)

    # -- loading --------------------------------------------------------------------------------
    def load(self, path: Path, verified: bool = False) -> None:
        """Restore every state object from ``path``, verified first: in full, or by sizes only
        when ``verified`` (``resume=True`` has just checksummed it to choose it). Once loaded, the
        main rank tidies ``output_dir`` (stale temp directories removed, newer checkpoints of an
        abandoned continuation moved aside)."""
        cfg, strategy = self.config, self.strategy
        path = Path(path)
        strategy.collectives.barrier("resume")  # no rank is still looking for the checkpoint to resume from
        self._check_resumable(path, verify_checkpoint(path, hashes=cfg.verify_hashes and not verified))
        check_optimizer_fits(self.module, cfg, path)
        strategy.load_checkpoint_state(path, self.model, self.optimizer)
        if self.scheduler is not None:
            if not (path / "scheduler.pt").exists():
                raise CheckpointError(f"{path} has no scheduler.pt but this run has a scheduler")
            self.scheduler.load_state_dict(torch_load(path / "scheduler.pt"))
        strategy.precision.load_state_dict(torch_load(path / "precision.pt"))
        self.callbacks.load_state_dict(torch_load(path / "callbacks.pt"))
        saved = json.loads((path / "trainer_state.json").read_text())
        order = self.loop.load_state_dict(saved, path, strategy.global_rank, strategy.world_size,
                                          cfg.resume_data_changed)
        state = self.loop.state
        state.best_checkpoint = resolve_best(cfg.output_dir, state.best_checkpoint, state.best_step)
        choose_best_again(cfg, state, path)  # metric_for_best or greater_is_better changed
        self._load_rng(path, saved.get("world_size", 1))
        apply_changed_settings(cfg, self.module, self.optimizer, self.scheduler, path, order)
        self.resumed_from, self.latest = str(path), path
        if strategy.is_global_zero:
            tidy_output_dir(cfg.output_dir, state.global_step, path)
        log.info("resumed from %s at step %d (epoch %d, %d samples into it)", path, state.global_step,
                 state.epoch_index, state.samples_in_epoch)

    def _check_resumable(self, path: Path, manifest: dict[str, Any]) -> None:
        meta = manifest.get("meta", {})
        if meta.get("kind") == "model" or not (path / "trainer_state.json").exists():
            raise CheckpointError(
                f"{path} holds weights only (saved with save_only_model=True) and cannot be resumed; "
                "load its weights with module.load_weights(path) and start a new fit")
        layout = meta.get("state_format", "full")
        if layout not in self.strategy.resumes_from:  # its optimizer state cannot be restored here
            raise CheckpointError(
                f"{path} was written by {LAYOUTS.get(layout, repr(layout))}, and the {self.strategy.name} strategy "
                "cannot restore its optimizer state: resume it with the strategy that wrote it, or start a new fit "
                "from its weights: " + ("module.load_weights(path) before fit()"
                                        if (path / "model.safetensors").is_file() else
                                        f"`lightlike export {path} OUT_DIR`, then module.load_weights(OUT_DIR) "
                                        "before fit()"))

    def _load_rng(self, path: Path, saved_world_size: int) -> None:
        strategy, rank = self.strategy, self.strategy.global_rank
        if saved_world_size != strategy.world_size:
            log.warning("resuming a run saved on %s process(es) on %s: data position is kept (in global "
                        "samples) but RNG streams are re-derived, so this is not a bit-exact continuation",
                        saved_world_size, strategy.world_size)
            self.rng.reseed(self.config.seed + 7919 * (rank + 1) + self.loop.state.global_step)
        else:
            self.rng.load_state_dict(torch_load(path / "rng.pt")[rank])

    def load_weights(self, path: Path) -> None:
        """Load only the weights of a checkpoint (``load_best_at_end``): the one saved at the best
        step, or none (with a warning, and ``best_checkpoint`` cleared) if ``path`` is another."""
        state = self.loop.state
        if resolve_best(path.parent, str(path), state.best_step) is None:
            log.warning("load_best_at_end: the best evaluation (step %s) has no checkpoint of its own (%s is "
                        "another step's); keeping the final weights", state.best_step, path.name)
            state.best_checkpoint = None
            return
        verify_checkpoint(path, hashes=self.config.verify_hashes)
        self.strategy.load_checkpoint_state(path, self.model, None)
        log.info("loaded the best checkpoint's weights from %s", path)

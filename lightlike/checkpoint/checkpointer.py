"""``Checkpointer``: saves and loads a fit's training checkpoints, driven by its registry.

Layout of ``output_dir/checkpoint-{step}/`` (every file listed with size and checksum in
``manifest.json``, which is written last; see ``atomic.py``; the names: ``files.py``)::

    model.safetensors     full weights (strategies that shard write their own files instead;
                          the manifest's meta names the layout: ``state_format``)
    hparams.json          the module's hyperparameters, when it recorded any
    base_fingerprint.json the frozen base's fingerprint, when the module checkpoints only the
                          part it trains (``TaskModule.checkpoint_keys``; ``frozen.py``)
    config.json           the FitConfig of the run
    optimizer.pt          optimizer state (the strategy's too)  \\
    scheduler.pt          LR scheduler state                     |
    precision.pt          GradScaler state                       |
    callbacks.pt          callback states                        |  absent with save_only_model=True
    trainer_state.json    FitState + data position + pending     |  (such a checkpoint cannot be
                          loss values                            |  resumed)
    rng.pt                RNG states, one per rank               |
    state-<name>.pt       each of Fitter(states=...)            /

The weights and optimizer state are the strategy's (``strategy.checkpoint_layout``'s ``save`` /
``load``, ``strategies/layouts.py``), which knows their layout; everything else is an entry of the
``Registry`` (``registry.py``): a named object with ``state_dict``/``load_state_dict`` and its
file. A resume reads every entry, lets each refuse the checkpoint, restores the strategy's state,
then every entry, then runs each entry's post-load policy. The checkpointer also owns the
asynchronous write in flight; the Fitter, preemption, the out-of-memory retry and fail-fast call
its public methods.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightlike.checkpoint.atomic import CheckpointWriter, not_saved_error, set_aside_in_the_way
from lightlike.checkpoint.files import LAYOUTS, TRAINER_STATE_FILE, WEIGHTS_FILE
from lightlike.checkpoint.manifest import list_checkpoints, start_verifying, verify_checkpoint
from lightlike.checkpoint.registry import Registry
from lightlike.checkpoint.resume import resolve_best, tidy_output_dir
from lightlike.checkpoint.rotation import rotate_checkpoints
from lightlike.checkpoint.training import LoopState
from lightlike.config import FitConfig
from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")


class Checkpointer:
    """Saves and loads this fit's training checkpoints. Every method that writes or reads is
    collective: every rank calls it at the same point."""

    def __init__(self, config: FitConfig, strategy: Any, *, module: Any, model: Any, optimizer: Any,
                 scheduler: Any, callbacks: Any, loop: LoopState, states: Mapping[str, Any] | None = None,
                 registry: Registry | None = None, base: Any = None):
        """The fit's objects; ``registry`` defaults to ``Registry.of_fit`` of them, with the user's
        ``states`` (``Fitter(states=...)``) after the built-in entries."""
        self.strategy = strategy
        self.module, self.model, self.optimizer, self.scheduler = module, model, optimizer, scheduler
        self.callbacks, self.loop = callbacks, loop
        self.registry = registry if registry is not None else Registry.of_fit(
            config, strategy, module=module, optimizer=optimizer, scheduler=scheduler, callbacks=callbacks,
            loop=loop, states=states, base=base)
        self.config = config
        self.in_flight: tuple[CheckpointWriter, Any, Any] | None = None  # (writer, shards' future, seal's future)
        self.resumed_from: str | None = None
        self.written: set[Path] = set()  # the checkpoints this fit committed: the only ones a save replaces
        self.latest: Path | None = None  # the checkpoint last committed or resumed from

    @property
    def config(self) -> FitConfig:
        return self._config

    @config.setter
    def config(self, config: FitConfig) -> None:
        """This fit's config, which ``config.json`` holds (a benchmark swaps it between saves)."""
        self._config = config
        if "config" in self.registry.entries:
            self.registry["config"].config = config

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
            shards = strategy.checkpoint_layout.save(writer, self.model, self.optimizer if full else None)
            # every rank's part of the per-rank entries (random state, pending losses, batches taken in the epoch)
            parts = strategy.collectives.all_gather_object(self.registry.rank_states()) if full else []
            if strategy.is_global_zero:
                self.registry.write(writer, full, parts)
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
        meta = {"kind": "full" if full else "model", "state_format": strategy.checkpoint_layout.format}
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
        """Restore the strategy's state and every registry entry from ``path``, verified first:
        in full, or by sizes only when ``verified`` (``resume=True`` has just checksummed it to
        choose it). Every entry's file is read and each entry may refuse the checkpoint before
        anything is restored; each entry's post-load policy runs once all are restored. Then the
        main rank tidies ``output_dir`` (stale temp directories removed, newer checkpoints of an
        abandoned continuation moved aside)."""
        cfg, strategy = self.config, self.strategy
        path = Path(path)
        strategy.collectives.barrier("resume")  # no rank is still looking for the checkpoint to resume from
        check = start_verifying(path, hashes=cfg.verify_hashes and not verified)
        with check.first():  # the files are read while their checksums are computed
            self._check_resumable(path, check.manifest)
            loading = self.registry.read(path, cfg, strategy.global_rank, strategy.world_size)
            self.registry.check_resume(loading)
            strategy.checkpoint_layout.load(path, self.model, self.optimizer, verified=check.wait)
        self.registry.load(loading)
        self.resumed_from, self.latest = str(path), path
        state = self.loop.state
        if strategy.is_global_zero:
            tidy_output_dir(cfg.output_dir, state.global_step, path)
        log.info("resumed from %s at step %d (epoch %d, %d samples into it)", path, state.global_step,
                 state.epoch_index, state.samples_in_epoch)

    def _check_resumable(self, path: Path, manifest: dict[str, Any]) -> None:
        meta = manifest.get("meta", {})
        if meta.get("kind") == "model" or not (path / TRAINER_STATE_FILE).exists():
            raise CheckpointError(
                f"{path} holds weights only (saved with save_only_model=True) and cannot be resumed; "
                "load its weights with module.load_weights(path) and start a new fit")
        layout = meta.get("state_format", "full")
        if layout not in self.strategy.checkpoint_layout.resumes_from:  # its optimizer state cannot be restored here
            raise CheckpointError(
                f"{path} was written by {LAYOUTS.get(layout, repr(layout))}, and the {self.strategy.name} strategy "
                "cannot restore its optimizer state: resume it with the strategy that wrote it, or start a new fit "
                "from its weights: " + ("module.load_weights(path) before fit()"
                                        if (path / WEIGHTS_FILE).is_file() else
                                        f"`lightlike export {path} OUT_DIR`, then module.load_weights(OUT_DIR) "
                                        "before fit()"))

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
        self.strategy.checkpoint_layout.load(path, self.model, None)
        log.info("loaded the best checkpoint's weights from %s", path)

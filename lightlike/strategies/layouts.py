"""Checkpoint layouts: how a strategy writes and reads the weights and optimizer state of a checkpoint.

A strategy holds one, ``strategy.checkpoint_layout``. The Checkpointer saves and loads through
it, records its ``format`` in the manifest's meta (``state_format``), and refuses to resume a
checkpoint whose format is not in its ``resumes_from`` before anything loads (its weights can
still start a new fit).

- ``FullLayout`` (``"full"``; single, DDP): the full weights as ``model.safetensors`` and the
  optimizer's ``state_dict`` as ``optimizer.pt``, written by the main rank. Loads a ``"dcp"``
  checkpoint too: DCP's names do not depend on the sharding.
- ``DCPLayout`` (``"dcp"``; FSDP): each rank writes its shards into ``dcp/`` through
  ``torch.distributed.checkpoint`` (in the background with ``async_save``); loads onto any world size.
- ``DeepSpeedLayout`` (``"deepspeed"``): the engine's own files in ``deepspeed/`` (tag ``state``)
  and ``deepspeed_meta.json``; resumes on another world size or ZeRO stage through DeepSpeed's
  universal checkpoint.

Each promises: ``save`` and ``load`` run on every rank (they may be collective); ``module_state_dict``
gives the full, unsharded weights with the user's keys, ``load_module_state_dict`` sets them.
``FullLayout`` and ``DCPLayout`` save only the keys the module's ``checkpoint_keys()`` names (a
PEFT adapter without its frozen base: ``lightlike/checkpoint/frozen.py``) and load those back.
"""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightlike.checkpoint.files import OPTIMIZER_FILE, WEIGHTS_FILE
from lightlike.errors import CheckpointError

if TYPE_CHECKING:
    from lightlike.strategies.base import Strategy
    from lightlike.strategies.deepspeed import DeepSpeedStrategy
    from lightlike.strategies.fsdp import FSDPStrategy

log = logging.getLogger("lightlike")

#: where ``DeepSpeedLayout.save`` puts DeepSpeed's files inside a checkpoint, and the tag
DS_DIR, DS_TAG, META = "deepspeed", "state", "deepspeed_meta.json"


class CheckpointLayout(ABC):
    """How a strategy lays out weights and optimizer state in a checkpoint (see the module's
    docstring). It holds its strategy, for the ranks, the collectives and ``unwrap``. One object
    in place of six Strategy members of earlier versions: ``checkpoint_format`` (``format``),
    ``resumes_from``, ``save_checkpoint_state`` (``save``), ``load_checkpoint_state`` (``load``),
    ``module_state_dict`` and ``load_module_state_dict``."""

    #: recorded in the manifest's meta as ``state_format``
    format: str = "full"
    #: the formats a run resumes from under this layout, optimizer state included (a checkpoint
    #: of another format is refused before anything loads; its weights can start a new fit)
    resumes_from: tuple[str, ...] = ("full", "dcp")

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @abstractmethod
    def save(self, writer: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        """Write the weights, and the optimizer state unless ``optimizer`` is None, into the
        checkpoint that ``writer`` (a ``CheckpointWriter`` whose temp directory every rank shares)
        is assembling. Called on every rank, so it may be collective; files go to
        ``writer.path_for(rel)``. Returns None when the files are written, or a future
        (``.result()``) for a write still going on in the background, which the checkpoint layer
        waits on before committing."""

    @abstractmethod
    def load(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             verified: Callable[[], None] = lambda: None) -> None:
        """Restore what ``save`` wrote into a checkpoint at ``path`` (weights only when
        ``optimizer`` is None). Called on every rank. ``verified()`` returns once the files'
        checksums are known good (it raises otherwise): called before anything is set, after
        the files are read where they can be read first."""

    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights of the user's module (on CPU), for ``model.safetensors``."""
        return {k: v.detach() for k, v in self.strategy.unwrap(module).state_dict().items()}

    def load_module_state_dict(
        self, module: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Set the full weights ``state`` (as ``module_state_dict`` gives them) into the module."""
        from lightlike.checkpoint.weights import load_module_state

        load_module_state(self.strategy.unwrap(module), state, strict=strict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(format={self.format!r})"


class FullLayout(CheckpointLayout):
    """``"full"``: ``model.safetensors`` + ``optimizer.pt``, the full state gathered
    (``module_state_dict``, which may be collective) and written by the main rank. Single and
    DDP: every rank holds it all."""

    def save(self, writer: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from lightlike.checkpoint.frozen import saved_state

        weights = saved_state(self.strategy.unwrap(module), self.module_state_dict(module))  # checkpoint_keys'
        optim_state = optimizer.state_dict() if optimizer is not None else None
        if self.strategy.is_global_zero:
            writer.save_safetensors(WEIGHTS_FILE, weights)
            if optim_state is not None:
                writer.save_torch(OPTIMIZER_FILE, optim_state)

    def load(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             verified: Callable[[], None] = lambda: None) -> None:
        """Restore what ``save`` wrote (both files read while ``verified`` checks them, then
        set); a sharded DCP checkpoint (written by FSDP) loads too: its names do not depend on
        the sharding."""
        from lightlike.checkpoint.weights import load_safetensors

        if (path / "dcp").is_dir():
            from lightlike.checkpoint.dcp import load_dcp_state

            verified()
            load_dcp_state(path / "dcp", self.strategy.unwrap(module), optimizer)
            return

        weights = load_safetensors(path / WEIGHTS_FILE)
        state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True) if optimizer is not None else None
        verified()
        self.load_module_state_dict(module, weights)
        if optimizer is not None:
            try:
                optimizer.load_state_dict(state)
            except ValueError as e:  # (after the optimizer's own load hooks, which may adapt the state)
                if "parameter group" not in str(e):
                    raise
                raise group_size_error(optimizer, state, path) from e


class DCPLayout(CheckpointLayout):
    """``"dcp"``: each rank writes its shards (``torch.distributed.checkpoint``) into ``dcp/``;
    loading reshards onto any world size. With FSDP's ``async_save=True`` the state is staged to
    CPU memory and written in the background over ``group`` (a CPU process group of its own);
    the returned future is waited on before commit. Weights-only loads take a "full"
    checkpoint's ``model.safetensors`` too."""

    format = "dcp"
    resumes_from = ("dcp",)
    strategy: FSDPStrategy

    def __init__(self, strategy: FSDPStrategy) -> None:
        super().__init__(strategy)
        #: the process group of a background write (None: the default group)
        self.group: Any = None

    def save(self, writer: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        from lightlike.checkpoint.dcp import DCP_DIR, save_dcp_state

        # FSDP leaves buffers (BatchNorm statistics) to each rank: the checkpoint holds rank 0's,
        # so every rank takes them here, and a run resumed from it goes on as this one does
        self.strategy.broadcast_buffers(module)
        return save_dcp_state(writer.path_for(DCP_DIR), self.strategy.unwrap(module), optimizer, self.group)

    def load(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             verified: Callable[[], None] = lambda: None) -> None:
        from lightlike.checkpoint.dcp import DCP_DIR, load_dcp_state

        verified()
        if (path / DCP_DIR).is_dir():
            load_dcp_state(path / DCP_DIR, self.strategy.unwrap(module), optimizer)
            return
        # weights only: a full resume from another layout was refused (resumes_from)
        from lightlike.checkpoint.weights import load_safetensors

        self.load_module_state_dict(module, load_safetensors(path / WEIGHTS_FILE))

    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights, all-gathered from the shards (collective; every rank gets them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full: dict[str, Any] = get_model_state_dict(self.strategy.unwrap(module),
                                                    options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in full.items()}

    def load_module_state_dict(self, module: nn.Module, state: Any, strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from lightlike.checkpoint.weights import check_fits

        inner = self.strategy.unwrap(module)
        own = check_fits(inner, state, strict=strict)  # the part the module checkpoints: the rest stays
        strict = strict and len(own) == len(inner.state_dict())
        set_model_state_dict(inner, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))


class DeepSpeedLayout(CheckpointLayout):
    """``"deepspeed"``: every rank calls ``engine.save_checkpoint`` into ``deepspeed/`` (tag
    ``state``): the module states and each rank's ZeRO partitions (fp32 master weights, optimizer
    state), with ``deepspeed_meta.json`` (world size, stage, config) by the main rank. Weights-only
    checkpoints hold ``model.safetensors`` gathered in fp32. Full weights come from the fp32
    master partitions (exact: no 16-bit round trip). Before the engine exists, as ``FullLayout``'s."""

    format = "deepspeed"
    resumes_from = ("deepspeed",)
    strategy: DeepSpeedStrategy

    def _engine(self) -> Any:
        if self.strategy.engine is None:
            raise RuntimeError("the DeepSpeed engine is not set up (setup_optimizer has not run)")
        return self.strategy.engine

    # -- full weights ----------------------------------------------------------------------------------
    def _named_params(self, inner: nn.Module) -> dict[str, nn.Parameter]:
        return dict(inner.named_parameters(remove_duplicate=False))

    def _full_param(self, p: nn.Parameter) -> torch.Tensor:
        """The exact full value of one parameter on every rank (collective under ZeRO): the fp32
        master weights for trained parameters, the parameter itself for frozen ones."""
        from deepspeed.utils import safe_get_full_fp32_param

        zero3 = hasattr(p, "ds_id")
        shape = p.ds_shape if zero3 else p.shape  # type: ignore[attr-defined]
        if not zero3 and p.dtype == torch.float32:
            return p.detach().clone()  # ZeRO-1/2 with fp32 parameters: a full copy of the master weights
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is None:  # frozen: not in the optimizer, no master copy
            if zero3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p]):
                    return p.detach().clone()
            return p.detach().clone()
        return full.detach().reshape(shape).clone()

    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights with the user's keys on every rank (collective): trained parameters from the
        fp32 master partitions (exact: no 16-bit round trip), buffers as the module holds them."""
        if self.strategy.engine is None:
            return super().module_state_dict(module)
        inner = self.strategy.engine.module
        params = self._named_params(inner)
        cache: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for key, value in inner.state_dict().items():
            p = params.get(key)
            if p is None:
                out[key] = value.detach().cpu().clone()
                continue
            if id(p) not in cache:
                cache[id(p)] = self._full_param(p).cpu()
            out[key] = cache[id(p)]
        return out

    def load_module_state_dict(self, module: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Set full weights on every rank (collective): the module's parameters (gathered and
        re-partitioned under ZeRO-3) and the fp32 master partitions the optimizer steps."""
        strategy = self.strategy
        if strategy.engine is None:
            return super().load_module_state_dict(module, state, strict)
        from deepspeed.utils import safe_set_full_fp32_param

        from lightlike.strategies import deepspeed_fixes as ds_fixes

        inner = strategy.engine.module
        params = self._named_params(inner)
        own = inner.state_dict()
        shapes = {k: tuple(params[k].ds_shape) if hasattr(params.get(k), "ds_id")  # type: ignore[attr-defined]
                  else tuple(v.shape) for k, v in own.items()}
        _check_keys(type(inner).__name__, shapes, state, strict)
        done: set[int] = set()
        buffers = {}
        for key in own:
            if key not in state:
                continue
            p = params.get(key)
            if p is None:
                buffers[key] = state[key]
                continue
            if id(p) in done:
                continue
            done.add(id(p))
            value = state[key].to(device=p.device)
            if hasattr(p, "ds_id"):
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if strategy.global_rank == 0:
                        p.data.copy_(value.to(p.dtype).reshape(p.shape))
            else:
                p.data.copy_(value.to(p.dtype).reshape(p.shape))
            if p.requires_grad:
                if hasattr(p, "ds_id") and p.ds_numel % strategy.world_size:  # type: ignore[attr-defined]
                    ds_fixes.set_zero3_master_padded(p, value)
                else:
                    safe_set_full_fp32_param(p, value.float())
        if buffers:
            inner.load_state_dict(buffers, strict=False)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save(self, writer: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Every rank: ``engine.save_checkpoint`` into ``deepspeed/`` (tag ``state``), synchronous,
        so each rank's files are closed when it returns. Weights only (``optimizer=None``): the
        gathered fp32 weights as ``model.safetensors``, written by the main rank."""
        strategy = self.strategy
        if optimizer is None:
            weights = self.module_state_dict(module)
            if strategy.is_global_zero:
                writer.save_safetensors(WEIGHTS_FILE, weights)
            return
        engine = self._engine()
        strategy.broadcast_buffers(module)  # the checkpoint holds rank 0's (DeepSpeed leaves them to each rank)
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        # the universal-checkpoint marker lets DeepSpeed's converter (resume on another world size) read it
        client_state = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
        engine.save_checkpoint(str(writer.path_for(DS_DIR)), tag=DS_TAG, client_state=client_state, save_latest=False)
        if strategy.is_global_zero:
            writer.write_json(META, {"world_size": strategy.world_size, "stage": strategy.stage, "dir": DS_DIR,
                                     "tag": DS_TAG, "precision": strategy.precision.name,
                                     "deepspeed_config": strategy.ds_config})

    def load(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
             verified: Callable[[], None] = lambda: None) -> None:
        """Restore a checkpoint saved by this layout (``verified()`` first).

        - Same world size: ``engine.load_checkpoint`` (module strict, ZeRO partitions with fp32
          master weights and optimizer state; not DeepSpeed's LR scheduler: lightlike restores its
          own): a bit-exact continuation.
        - Another world size (2 -> 1, 1 -> 2, ...) or ZeRO stage: DeepSpeed cannot re-partition its ZeRO files
          directly, so the main rank converts them into DeepSpeed's *universal checkpoint* (per-
          parameter fp32 weights and Adam moments, ``deepspeed.checkpoint.ds_to_universal``) in a
          temp directory next to the checkpoint, and every rank loads that with
          ``load_universal``. Weights and optimizer state carry over; the run continues as the
          uninterrupted one would, up to float rounding (gradients are reduced over a different
          number of ranks) and the RNG note ``training.py`` logs. The checkpoint is not modified.
        - ``optimizer=None`` (weights only, e.g. ``load_best_at_end``): ``model.safetensors`` if the
          checkpoint has it, else the fp32 weights consolidated from the partitions (zero-to-fp32).
        - A checkpoint of another strategy: refused before this is called (``resumes_from``);
          its weights (``optimizer=None``) load.
        """
        from lightlike.checkpoint.weights import load_safetensors

        verified()
        strategy = self.strategy
        meta_file = path / META
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
        if meta is None or optimizer is None:
            if (path / WEIGHTS_FILE).is_file():
                self.load_module_state_dict(module, load_safetensors(path / WEIGHTS_FILE))
                return
            if meta is None:
                raise CheckpointError(f"{path} holds neither model.safetensors nor a DeepSpeed checkpoint "
                                      f"({META} is missing)")
            from lightlike.checkpoint.zero import consolidated_state_dict

            weights = consolidated_state_dict(path) if strategy.is_global_zero else None
            self.load_module_state_dict(module, strategy.collectives.broadcast_object(weights) if strategy.world_size > 1 else weights)  # type: ignore[arg-type]
            return
        engine = self._engine()
        if meta["world_size"] == strategy.world_size and meta.get("stage") == strategy.stage:
            from lightlike.checkpoint.zero import check_deepspeed_files

            load_dir, tag = str(path / meta["dir"]), meta["tag"]
            check_deepspeed_files(Path(load_dir) / tag)  # DeepSpeed's loader unpickles whatever they hold
            load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
        else:
            load_path = self._load_resharded(path, meta["world_size"], meta.get("stage"))
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {path / meta['dir']}")

    def _load_resharded(self, path: Path, saved_world_size: int, saved_stage: int | None) -> Any:
        import secrets
        import shutil

        from lightlike.checkpoint.zero import to_universal
        from lightlike.strategies import deepspeed_fixes as ds_fixes

        strategy = self.strategy
        engine = self._engine()
        if saved_stage is not None and (saved_stage == 3) != (strategy.stage == 3):
            raise CheckpointError(
                f"{path.name} was saved with ZeRO-{saved_stage} and this run uses ZeRO-{strategy.stage}: DeepSpeed's "
                "universal checkpoint does not move between ZeRO-3 and ZeRO-1/2 (their model-state files differ). "
                f"Resume with a ZeRO-{'3' if saved_stage == 3 else '1 or 2'} strategy, or export the weights "
                f"(`lightlike export {path} OUT`) and start a new fit from them")
        basic = getattr(engine, "basic_optimizer", None)
        if basic is not None and "betas" not in getattr(basic, "defaults", {}):
            raise CheckpointError(
                f"{path.name} was saved on {saved_world_size} process(es) with ZeRO-{saved_stage} and this run has "
                f"{strategy.world_size} with ZeRO-{strategy.stage}: re-partitioning optimizer state goes through DeepSpeed's "
                f"universal checkpoint, which carries Adam-family state only, not {type(basic).__name__}'s. Resume "
                "with the saved world size and stage, or export the weights and start a new fit from them")
        log.warning("resuming a DeepSpeed checkpoint saved on %d process(es) with ZeRO-%s on %d with ZeRO-%d: "
                    "converting it to DeepSpeed's universal checkpoint format to re-partition weights and optimizer "
                    "state", saved_world_size, saved_stage, strategy.world_size, strategy.stage)
        tmp: Any = None
        error: str | None = None
        if strategy.is_global_zero:
            # a name cleanup_stale_temps removes if this process dies before removing it
            tmp = path.parent / f".checkpoint-universal.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                to_universal(path, tmp)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = f"{type(e).__name__}: {e}"
        tmp, error = strategy.collectives.broadcast_object((str(tmp), error)) if strategy.world_size > 1 else (str(tmp), error)
        try:
            if error is not None:
                raise CheckpointError(f"converting {path} to DeepSpeed's universal checkpoint failed: {error}")
            engine._config.load_universal_checkpoint = True  # read by load_checkpoint, fixed at initialize otherwise
            try:
                load_path, _ = engine.load_checkpoint(tmp, tag="state", load_module_strict=True,
                                                      load_optimizer_states=True, load_lr_scheduler_states=False)
            finally:
                engine._config.load_universal_checkpoint = False
            if strategy.stage == 3:
                ds_fixes.repair_zero3_universal_load(engine.optimizer, Path(tmp) / "state" / "zero" / "optimizer_state.pt")
            ds_fixes.restore_buffers_after_universal_load(strategy, engine.module, path)
        finally:
            strategy.collectives.barrier()
            if strategy.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)
        return load_path


def _check_keys(owner: str, shapes: Mapping[str, tuple[int, ...]], state: Mapping[str, torch.Tensor],
                strict: bool) -> None:
    missing = [k for k in shapes if k not in state]
    unexpected = [k for k in state if k not in shapes]
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs module {shapes[k]}"
                  for k in shapes if k in state and tuple(state[k].shape) != shapes[k]]
    problems = []
    if strict and missing:
        problems.append(f"  {len(missing)} missing keys: {', '.join(missing[:10])}")
    if strict and unexpected:
        problems.append(f"  {len(unexpected)} unexpected keys: {', '.join(unexpected[:10])}")
    if mismatched:
        problems.append(f"  {len(mismatched)} shape mismatches: {', '.join(mismatched[:10])}")
    if problems:
        raise CheckpointError(f"the weights do not fit {owner}:\n" + "\n".join(problems))


def group_size_error(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], path: Path) -> Exception:
    """torch's refusal of an optimizer state whose parameter groups hold other numbers of
    parameters than the optimizer's, as an error that says which and why."""
    saved = [len(g.get("params", ())) for g in state.get("param_groups", ())]
    now = [len(g["params"]) for g in optimizer.param_groups]
    return CheckpointError(
        f"{path.name}: its optimizer state holds parameter groups of {saved} parameters, this run's optimizer "
        f"{now}: the trainable parameters changed (frozen, added) or so did their grouping (lightlike's built-in "
        "optimizer keeps every parameter whose name contains 'bias' out of weight decay, as the HF Trainer; "
        "before 2026-11-24 it decayed 2-D ones such as T5's relative_attention_bias). Start a new fit from its "
        f"weights (module.load_weights('{path}') before fit, without resume)")

"""Sharded checkpoint state through ``torch.distributed.checkpoint`` (DCP).

Layout inside ``checkpoint-{step}/``: ``dcp/`` holds DCP's ``.metadata`` and one ``__{rank}_0.distcp``
file per rank, with the keys ``model.<fqn>`` and (unless weights only) ``optim.state.<fqn>.<name>``
and ``optim.param_groups.<fqn>.<name>``: torch's fully-qualified-name form, which does not depend
on how the state was sharded. Loading reads whatever slices the current sharding needs, so a
checkpoint written by FSDP on 2 ranks resumes on 1 (or 4) ranks, under FSDP or, because the names
are the same, under DDP or one device. This module imports DCP (about 1.6 s) only when used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightlike.checkpoint.frozen import expected_state, saved_state
from lightlike.checkpoint.weights import check_shapes, save_safetensors
from lightlike.errors import CheckpointError

DCP_DIR = "dcp"


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def save_dcp_state(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   async_group: Any = None) -> Any:
    """Every rank writes its own shards of the module (and optimizer) state into ``directory``.
    Collective when a process group exists. With ``async_group`` (a process group kept for
    checkpointing, so its collectives never interleave with training's), the state is copied to
    CPU memory here and written by a background thread: returns a future to wait on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state: dict[str, Any] = {"model": saved_state(module, get_model_state_dict(module))}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": saved_state(module, model_sd), "optim": optim_sd}  # what checkpoint_keys() names
    writer = dcp.FileSystemWriter(directory, sync_files=True)
    # a tensor every rank holds (a buffer) is written by the lowest rank holding it: rank 0's, the
    # copy the checkpoint promises (DCP's default takes whichever rank's plan is smallest)
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    if async_group is not None:
        return dcp.async_save(state, storage_writer=writer, planner=planner, process_group=async_group)
    dcp.save(state, storage_writer=writer, planner=planner)
    return None


def load_dcp_state(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   strict: bool = True) -> None:
    """Load a DCP checkpoint into the current (possibly differently sharded) module and
    optimizer. Missing, unexpected and mis-shaped keys (from DCP's metadata, before anything is
    read) are listed in one ``CheckpointError``, as ``check_fits`` lists them for full weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not directory.is_dir():
        raise CheckpointError(f"{directory.parent} has no sharded state ({DCP_DIR}/)")
    stored = _metadata(directory).state_dict_metadata
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if not any(k.startswith("optim.") for k in stored):
            raise CheckpointError(f"{directory.parent} holds weights only and cannot be resumed")
    # the part the module checkpoints (checkpoint_keys), and any frozen key the checkpoint holds too
    whole = len(state["model"])
    state["model"] = expected_state(module, state["model"], _stored_shapes(stored, state["model"]))
    strict_set = strict and len(state["model"]) == whole
    # names and global shapes, from DCP's metadata, before any rank reads: one error listing every
    # misfit, the same on every rank (DCP's own names one shape mismatch per rank)
    check_shapes(_class_name(module), _own_shapes(state["model"]), _stored_shapes(stored, state["model"]),
                 strict=strict, source=str(directory.parent))
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=planner)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        raise CheckpointError(f"{directory.parent} could not be loaded into {_class_name(module)}: "
                              f"{_failures(error)}") from error
    if optimizer is None:
        set_model_state_dict(module, state["model"], options=_options(strict=strict_set))
    else:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options(strict=strict_set))


def _class_name(module: nn.Module) -> str:
    """The user's class, not the one ``fully_shard`` derives from it (``FSDP<name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _own_shapes(model_sd: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Global shapes (a DTensor's ``shape`` is its global one); () for what is not a tensor."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else () for k, v in model_sd.items()}


def _stored_shapes(stored: dict[str, Any], model_sd: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The checkpoint's ``model.`` keys (without the prefix) and their global shapes; entries
    that are not tensors are taken to fit."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shapes = {}
    for key, item in stored.items():
        if key.startswith("model."):
            name = key[len("model."):]
            if isinstance(item, TensorStorageMetadata):
                shapes[name] = tuple(item.size)
            else:
                value = model_sd.get(name)
                shapes[name] = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    return shapes


def _failures(error: BaseException) -> str:
    """DCP's per-rank failures, one line each, without its tracebacks."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(error).__name__}: {error}"
    excs = {rank: f[0] if isinstance(f, tuple) else f for rank, f in sorted(failures.items())}
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in excs.items())


def _metadata(directory: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(directory).read_metadata()


def consolidate_to_safetensors(checkpoint_dir: str | Path, out_file: str | Path) -> None:
    """Write the full weights of a DCP checkpoint as one safetensors file, in one process with
    no process group: each rank's shards are read straight into full-size CPU tensors (peak
    memory: the weights once, never a rank's optimizer state), then written. Keys are the
    module's own names, so ``load_safetensors`` fits a fresh module."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(checkpoint_dir) / DCP_DIR
    meta = _metadata(directory)
    state: dict[str, Any] = {}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not state:
        raise CheckpointError(f"{checkpoint_dir} has no model weights in {DCP_DIR}/")
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    save_safetensors({k[len("model."):]: v for k, v in state.items()}, Path(out_file))

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
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    writer = dcp.FileSystemWriter(directory, sync_files=True)
    if async_group is not None:
        return dcp.async_save(state, storage_writer=writer, process_group=async_group)
    dcp.save(state, storage_writer=writer)
    return None


def load_dcp_state(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   strict: bool = True) -> None:
    """Load a DCP checkpoint into the current (possibly differently sharded) module and
    optimizer. Missing or unexpected keys are listed in one error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not directory.is_dir():
        raise CheckpointError(f"{directory.parent} has no sharded state ({DCP_DIR}/)")
    stored = {k for k in _metadata(directory).state_dict_metadata}
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(module)}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if not any(k.startswith("optim.") for k in stored):
            raise CheckpointError(f"{directory.parent} holds weights only and cannot be resumed")
    wanted = {f"model.{k}" for k in state["model"]}
    have = {k for k in stored if k.startswith("model.")}
    if strict and wanted != have:
        missing, unexpected = sorted(wanted - have), sorted(have - wanted)
        raise CheckpointError(
            f"{directory.parent} does not fit this module: missing keys {[m[6:] for m in missing][:20]}, "
            f"unexpected keys {[u[6:] for u in unexpected][:20]}")
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=planner)
    except Exception as error:  # shape mismatches surface here, per rank
        raise CheckpointError(f"{directory.parent} does not fit this module: {error}") from error
    if optimizer is None:
        set_model_state_dict(module, state["model"], options=_options(strict=strict))
    else:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options(strict=strict))


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

    from lightlike.checkpoint.weights import save_safetensors

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

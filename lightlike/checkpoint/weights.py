"""Weights in and out of ``model.safetensors``, with errors that list what does not fit."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")
_SHOW = 10


def load_module_state(module: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True,
                      source: str | None = None) -> None:
    """Load ``state`` into ``module``; list missing, unexpected and mis-shaped keys on error."""
    own = check_fits(module, state, strict, source)
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def check_fits(module: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True,
               source: str | None = None) -> dict[str, torch.Tensor]:
    """Raise one error listing missing, unexpected and mis-shaped keys; returns the module's
    state dict (shapes are global ones, also for sharded parameters): the part its checkpoints
    hold (``TaskModule.checkpoint_keys``), with any frozen key ``state`` holds too."""
    from lightlike.checkpoint.frozen import expected_state

    own = expected_state(module, module.state_dict(), state)
    check_shapes(type(module).__name__, own, state, strict, source)
    return own


def check_shapes(module_name: str, own: Mapping[str, Any], stored: Mapping[str, Any], strict: bool = True,
                 source: str | None = None) -> None:
    """The check behind ``check_fits``, on names and shapes alone: ``own`` (the module's) and
    ``stored`` (the checkpoint's) map each key to a tensor (or anything with a ``shape``) or to a
    shape. Raise one ``CheckpointError`` listing every missing, unexpected and mis-shaped key;
    with ``strict=False`` missing and unexpected keys are only warned about."""
    missing = [k for k in own if k not in stored]
    unexpected = [k for k in stored if k not in own]
    mismatched = [f"{k}: checkpoint {_shape(stored[k])} vs module {_shape(v)}"
                  for k, v in own.items() if k in stored and _shape(stored[k]) != _shape(v)]
    problems = []
    if strict and missing:
        problems.append(_listing("missing keys (in the module, not in the checkpoint)", missing))
    if strict and unexpected:
        problems.append(_listing("unexpected keys (in the checkpoint, not in the module)", unexpected))
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched))
    where = f" from {source}" if source else ""
    if problems:
        raise CheckpointError(f"the weights{where} do not fit {module_name}:\n" + "\n".join(problems))
    if missing or unexpected:  # strict=False: loaded what matches, and said what did not
        log.warning("strict=False: loading the weights%s into %s left out\n%s", where, module_name, "\n".join(
            [_listing("missing keys (kept as they were)", missing)] * bool(missing)
            + [_listing("unexpected keys (ignored)", unexpected)] * bool(unexpected)))


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, tuple) else tuple(value.shape)


def _listing(title: str, items: list[str]) -> str:
    more = f" ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"  {len(items)} {title}: " + ", ".join(items[:_SHOW]) + more


def save_safetensors(state: Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Save tensors to CPU safetensors; tensors sharing storage (tied weights) are cloned."""
    from safetensors.torch import save_file

    ptrs: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        t = v.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in ptrs or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()  # shared with another tensor, or a view into a larger buffer
        ptrs.add(t.untyped_storage().data_ptr())
        out[k] = t
    save_file(out, str(path), metadata=metadata)


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))

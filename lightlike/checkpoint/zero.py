"""DeepSpeed ZeRO checkpoints (``state_format="deepspeed"``) to full fp32 weights.

A checkpoint written by ``DeepSpeedStrategy`` holds DeepSpeed's own files under ``deepspeed/``
(tag ``state``: the module states and one ZeRO partition file per rank with the fp32 master
weights) and ``deepspeed_meta.json``. The weights are rebuilt with DeepSpeed's zero-to-fp32
(``deepspeed.utils.zero_to_fp32``), which concatenates every rank's fp32 partitions, so they are
exactly the master weights the run trained, with the user module's ``state_dict`` keys (the engine
saves ``engine.module``, the user's module, so there is no wrapper prefix; one is stripped if a
checkpoint has it). Buffers come from the module states file.

Export streams: the tensors are materialised one at a time from the partitions (DeepSpeed's lazy
mode) and written into one safetensors file as they come, so the peak memory is the partitions
plus one tensor, not a second full copy of the model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import pickle
import struct
from pathlib import Path
from typing import Any

import torch

from lightlike.errors import CheckpointError

META = "deepspeed_meta.json"

#: the Python classes DeepSpeed's checkpoint files hold besides tensors and plain values (0.16 to
#: 0.19: the loss scaler, the ZeRO stage, the fragment addresses of ZeRO-1/2's partitions)
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")
_extra_globals: list[Any] = []


def allow_deepspeed_globals(*classes: Any) -> None:
    """Let DeepSpeed checkpoint files hold these classes too (a DeepSpeed release that pickles a
    class ``DEEPSPEED_GLOBALS`` lacks): as ``torch.serialization.add_safe_globals``, for
    checkpoints you trust to name only what the class's unpickling does safely."""
    _extra_globals.extend(classes)


def deepspeed_globals() -> list[Any]:
    """``DEEPSPEED_GLOBALS`` imported (the ones this DeepSpeed has), and those allowed since."""
    import importlib

    found = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), attr))
    return found + _extra_globals


def load_deepspeed_file(path: Path, mmap: bool = False) -> Any:
    """One of DeepSpeed's ``.pt`` files, read as ``torch.load(weights_only=True)`` reads, with
    ``deepspeed_globals()`` allowed: a file naming any other global is refused."""
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        detail = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
        raise CheckpointError(
            f"{path} holds more than DeepSpeed's checkpoint files hold ({detail}): refused, since loading it "
            "could run code. If you wrote this checkpoint with a DeepSpeed release that saves that class and "
            "trust the file, allow the class with lightlike.checkpoint.allow_deepspeed_globals(cls)") from None


def check_deepspeed_files(ds_dir: Path) -> None:
    """Read every ``.pt`` file under ``ds_dir`` as ``load_deepspeed_file`` does (the pickles only:
    the tensors' bytes stay on disk), before DeepSpeed's own loaders, which unpickle anything,
    read them: a checkpoint whose files name other globals is refused, naming the file."""
    for f in sorted(ds_dir.rglob("*.pt")):
        load_deepspeed_file(f, mmap=True)


def _location(checkpoint_dir: Path) -> tuple[Path, str]:
    meta_file = checkpoint_dir / META
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        return checkpoint_dir / meta["dir"], meta["tag"]
    if (checkpoint_dir / "deepspeed").is_dir():
        return checkpoint_dir / "deepspeed", "state"
    raise CheckpointError(f"{checkpoint_dir} is not a DeepSpeed checkpoint written by lightlike ({META} is missing)")


def _lazy_state_dict(checkpoint_dir: str | Path) -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds_dir, tag = _location(Path(checkpoint_dir))
    if not (ds_dir / tag).is_dir():
        raise CheckpointError(f"{ds_dir / tag} does not exist: not a complete DeepSpeed checkpoint")
    check_deepspeed_files(ds_dir / tag)
    state = dict(get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=tag, lazy_mode=True))
    # frozen parameters: DeepSpeed (0.19.8) records them for zero-to-fp32 only at stage 2 and up;
    # under ZeRO-1 they are whole in the module states file (ZeRO-3 keeps empty placeholders there)
    states = sorted((ds_dir / tag).glob("*model_states.pt"))
    if states:
        module = load_deepspeed_file(states[0], mmap=True).get("module") or {}
        for key, value in module.items():
            if key not in state and isinstance(value, torch.Tensor) and value.numel() > 0:
                state[key] = value
    # the names are the user module's own: the engine records them from the module it was given
    # (compile=True, whose wrapper would add "_orig_mod.", is refused with DeepSpeed), so a
    # submodule of the user's named `module`, even the only one, keeps its name
    return state


def _materialise(value: Any) -> torch.Tensor:
    t = value.contiguous() if not isinstance(value, torch.Tensor) else value  # lazy GatheredTensor
    return t.detach().to("cpu").contiguous()


def consolidated_state_dict(checkpoint_dir: str | Path, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights (and buffers) with the user module's keys, on CPU; with ``only``, just
    those keys (the others are not read)."""
    return {k: _materialise(v).clone() for k, v in _lazy_state_dict(checkpoint_dir).items()
            if only is None or k in only}


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def consolidate_to_safetensors(checkpoint_dir: str | Path, out_file: str | Path) -> None:
    """Write the checkpoint's full fp32 weights as one safetensors file (the ``export_weights``
    consolidator for ``state_format="deepspeed"``), one tensor in memory at a time."""
    lazy = _lazy_state_dict(checkpoint_dir)
    # the header needs every tensor's dtype and shape first: read them without materialising
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for key in sorted(lazy):
        value = lazy[key]
        dtype, shape = _meta_of(value)
        if dtype not in _DTYPES:
            raise CheckpointError(f"{key}: dtype {dtype} cannot be written to safetensors here")
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        entries[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # align the data to 8 bytes, as safetensors does
    with open(out_file, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for key in sorted(lazy):
            t = _materialise(lazy[key])
            dtype, shape = _meta_of(lazy[key])
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{key}: materialised as {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
            fh.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            del t


def _meta_of(value: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    return value.dtype, tuple(value.shape)  # DeepSpeed's GatheredTensor knows both without gathering


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def to_universal(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Convert the checkpoint's ZeRO partitions into DeepSpeed's universal checkpoint format in
    ``out_dir/state`` (per-parameter fp32 weights and optimizer state, independent of the world
    size), with DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``), in this
    process. Returns ``out_dir``; load with tag ``state`` and ``checkpoint.load_universal``."""
    from deepspeed.checkpoint import ds_to_universal

    ds_dir, tag = _location(Path(checkpoint_dir))
    check_deepspeed_files(ds_dir / tag)
    args = argparse.Namespace(input_folder=str(ds_dir / tag), output_folder=str(Path(out_dir) / "state"),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    chatter = io.StringIO()  # the converter prints progress bars
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        ds_to_universal.main(args)
    logging.getLogger("lightlike").debug("universal checkpoint conversion:\n%s", chatter.getvalue())
    return Path(out_dir)


__all__ = ["consolidate_to_safetensors", "consolidated_state_dict", "to_universal"]

"""Export a checkpoint's weights as a plain ``model.safetensors`` (+ JSON configs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightlike.checkpoint.manifest import verify_checkpoint
from lightlike.errors import CheckpointError


def export_weights(checkpoint_dir: str | Path, out_dir: str | Path, hashes: bool = True) -> Path:
    """Verify ``checkpoint_dir`` and write ``out_dir/model.safetensors`` (plus ``hparams.json``
    and ``config.json`` when the checkpoint has them). Each file lands atomically; existing files
    in ``out_dir`` with those names are replaced. Returns the path of the weights.

    Sharded checkpoint formats (the distributed strategies) plug in here by consolidating their
    shards into the same single file."""
    src = Path(checkpoint_dir)
    verify_checkpoint(src, hashes=hashes)
    if not (src / "model.safetensors").is_file():
        raise CheckpointError(f"{src} has no model.safetensors to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "hparams.json", "config.json"):
        if (src / name).is_file():
            tmp = out / f".{name}.tmp-{os.getpid()}"
            shutil.copyfile(src / name, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, out / name)
    return out / "model.safetensors"

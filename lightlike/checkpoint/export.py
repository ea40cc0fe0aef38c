"""Export a checkpoint's weights as a plain ``model.safetensors`` (+ JSON configs)."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from pathlib import Path

from lightlike.checkpoint.manifest import verify_checkpoint
from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")

#: Consolidators for sharded layouts (manifest meta ``state_format``): "module:function", called as
#: ``function(checkpoint_dir, out_file)`` to write one ``model.safetensors`` from the shards.
CONSOLIDATORS: dict[str, str] = {
    "dcp": "lightlike.checkpoint.dcp:consolidate_to_safetensors",
    "deepspeed": "lightlike.checkpoint.zero:consolidate_to_safetensors",
}


def export_weights(checkpoint_dir: str | Path, out_dir: str | Path, hashes: bool = True) -> Path:
    """Verify ``checkpoint_dir`` and write ``out_dir/model.safetensors`` (plus ``hparams.json``
    and ``config.json`` when the checkpoint has them). Each file lands atomically; existing files
    in ``out_dir`` with those names are replaced (with a warning), and an earlier export's
    ``hparams.json``/``config.json`` that this checkpoint lacks is removed, so the folder
    describes one model. Returns the path of the weights.

    Sharded checkpoints (FSDP's DCP shards, DeepSpeed's ZeRO partitions) are consolidated into
    the same single file by the consolidator their ``state_format`` names."""
    src = Path(checkpoint_dir)
    manifest = verify_checkpoint(src, hashes=hashes)
    fmt = manifest.get("meta", {}).get("state_format", "full")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (src / "model.safetensors").is_file():
        if fmt not in CONSOLIDATORS:
            raise CheckpointError(f"{src} has no model.safetensors to export (state_format={fmt!r})")
        module_name, fn_name = CONSOLIDATORS[fmt].split(":")
        consolidate = getattr(importlib.import_module(module_name), fn_name)
        tmp = out / f".model.safetensors.tmp-{os.getpid()}"
        consolidate(src, tmp)
        fsync_replace(tmp, out / "model.safetensors")
    replaced = [name for name in ("model.safetensors", "hparams.json", "config.json") if (out / name).is_file()]
    for name in ("model.safetensors", "hparams.json", "config.json"):
        if (src / name).is_file():
            tmp = out / f".{name}.tmp-{os.getpid()}"
            shutil.copyfile(src / name, tmp)
            fsync_replace(tmp, out / name)
        elif name != "model.safetensors" and (out / name).is_file():
            (out / name).unlink()  # an earlier export's: it would describe another model
    if replaced:
        log.warning("export into %s replaced %s of an earlier export", out, ", ".join(replaced))
    return out / "model.safetensors"


def fsync_replace(tmp: Path, dest: Path) -> None:
    """Flush ``tmp`` to disk, then rename it over ``dest`` (readers see the old file or the new one)."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dest)

"""Atomic, verified checkpoints and what a training checkpoint holds."""

from lightlike.checkpoint.atomic import CheckpointWriter, cleanup_stale_temps
from lightlike.checkpoint.export import export_weights
from lightlike.checkpoint.manifest import (
    MANIFEST,
    checkpoint_step,
    file_hash,
    find_latest_valid,
    is_checkpoint_dir,
    list_checkpoints,
    verify_checkpoint,
)
from lightlike.checkpoint.rotation import rotate_checkpoints
from lightlike.checkpoint.weights import load_module_state, load_safetensors, save_safetensors

__all__ = [
    "MANIFEST",
    "CheckpointWriter",
    "checkpoint_step",
    "cleanup_stale_temps",
    "export_weights",
    "file_hash",
    "find_latest_valid",
    "is_checkpoint_dir",
    "list_checkpoints",
    "load_module_state",
    "load_safetensors",
    "rotate_checkpoints",
    "save_safetensors",
    "verify_checkpoint",
]

"""The names of a training checkpoint's files: the one table the registry and the readers use.

The names are those every checkpoint written so far holds; a checkpoint of an earlier version
loads because they do not change. ``registry.py`` maps each built-in entry to its file here.
"""

from __future__ import annotations

import re

#: the full weights, written by a strategy that gathers them (``FullLayout``, ``strategies/layouts.py``)
WEIGHTS_FILE = "model.safetensors"
#: the optimizer state, written by a strategy that gathers it
OPTIMIZER_FILE = "optimizer.pt"

#: each built-in registry entry's file, by entry name, in the order they are written and loaded
FILES = {
    "hparams": "hparams.json",  # the module's save_hyperparameters() record (never loaded back)
    "base_fingerprint": "base_fingerprint.json",  # the frozen base a partial module was trained on (frozen.py)
    "config": "config.json",  # the run's FitConfig
    "scheduler": "scheduler.pt",
    "precision": "precision.pt",  # the GradScaler's state
    "callbacks": "callbacks.pt",
    "trainer_state": "trainer_state.json",  # FitState, the data position, the pending losses
    "rng": "rng.pt",  # every rank's random state
}
HPARAMS_FILE, CONFIG_FILE, TRAINER_STATE_FILE = FILES["hparams"], FILES["config"], FILES["trainer_state"]

#: names no user state may take: the built-in entries, the strategy's and the manifest's
BUILT_IN_NAMES = ("model", "optimizer", *FILES, "manifest")

#: what a user state's name may hold (it becomes part of a file name)
USER_STATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: a user state's file (``states={"ema": ...}``: ``state-ema.pt``)
USER_STATE_FILE = "state-{}.pt"
USER_STATE_FILES = re.compile(r"^state-(.+)\.pt$")

#: who writes each checkpoint layout (the manifest's ``state_format``)
LAYOUTS = {"full": f"a strategy that gathers the full state (single, ddp: {WEIGHTS_FILE} + {OPTIMIZER_FILE})",
           "dcp": "FSDP (sharded, torch.distributed.checkpoint)", "deepspeed": "a DeepSpeed ZeRO strategy"}


def user_state_file(name: str) -> str:
    """The file of the user state ``name``."""
    return USER_STATE_FILE.format(name)

"""Config names and values as text: the HF Trainer's and Lightning's names for ``FitConfig``
fields (error hints), and values in the plain forms TOML, YAML and JSON hold."""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Any

from lightlike.errors import ConfigError

#: The HF Trainer's and Lightning's names for FitConfig fields (docs/migrating.md): an unknown key
#: that is one of them is answered with the field, not with a look-alike name.
OTHER_NAMES = {
    "lr": "learning_rate", "num_train_epochs": "max_epochs", "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size", "gradient_accumulation_steps": "grad_accum_steps",
    "accumulate_grad_batches": "grad_accum_steps", "lr_scheduler_type": "lr_scheduler", "optim": "optimizer",
    "optim_args": "optimizer_kwargs (a dict {'k': v}, or the HF string 'k=v,k2=v2')",
    "optim_target_modules": "optimizer_target_modules",
    "bf16": "precision='bf16-mixed'", "fp16": "precision='16-mixed'", "eval_steps": "eval_every",
    "eval_strategy": "eval_every or eval_on_epoch_end", "evaluation_strategy": "eval_every or eval_on_epoch_end",
    "logging_steps": "log_every", "report_to": "loggers", "save_steps": "save_every",
    "load_best_model_at_end": "load_best_at_end", "metric_for_best_model": "metric_for_best",
    "log_level_replica": "log_level_other_ranks", "full_determinism": "deterministic",
    "dataloader_num_workers": "num_workers", "dataloader_drop_last": "drop_last",
    "dataloader_pin_memory": "pin_memory", "torch_compile": "compile", "gradient_clip_val": "max_grad_norm",
    "resume_from_checkpoint": "fit(..., resume=True or 'path')",
    "val_check_interval": "eval_every or eval_on_epoch_end", "check_val_every_n_epoch": "eval_on_epoch_end",
    "enable_progress_bar": "progress_bar", "disable_tqdm": "progress_bar (the opposite sense: false hides the bar)",
    "default_root_dir": "output_dir", "logging_dir": "output_dir (the logs go in output_dir/logs)",
    "logging_strategy": "log_every",
    "fsdp": "strategy='fsdp' (its options: a preset .toml file as the strategy, see strategies/fsdp.toml)",
    "deepspeed": "strategy='deepspeed_zero3' (or the path of your DeepSpeed config .json file as the strategy)",
    "gradient_clip_algorithm": "max_grad_norm or max_grad_value",
    "devices": "accelerator (lightlike runs one process per device, started by torchrun --nproc_per_node N "
               "or srun: there is no device count to set)",
    # no setting of their own: the launcher or the scheduler decides (the text after "!" is the answer)
    "num_nodes": "!the launcher sets the nodes: torchrun --nnodes N, or sbatch --nodes N (strategies/ has recipes)",
    "nnodes": "!the launcher sets the nodes: torchrun --nnodes N, or sbatch --nodes N (strategies/ has recipes)",
    "gpus": "!lightlike runs one process per device, started by torchrun --nproc_per_node N or srun",
    "n_gpu": "!lightlike runs one process per device, started by torchrun --nproc_per_node N or srun",
    "nproc_per_node": "!that is torchrun's own flag: torchrun --nproc_per_node N your_script.py",
    "num_processes": "!lightlike runs one process per device, started by torchrun --nproc_per_node N or srun",
    "max_time": "!bound a run by max_steps or max_epochs; under a scheduler's time limit, a preemption signal "
                "(preemption_signals, sbatch --signal) saves and exits",
}


def other_name_hint(name: str, flag: bool = False) -> str | None:
    """``did you mean ...?`` for an HF Trainer / Lightning name (``OTHER_NAMES``), or None.
    ``flag``: as command-line flags (``--precision 16-mixed``, ``--eval_every or --eval_on_epoch_end``).
    A value's `` (note)`` follows the question."""
    other = OTHER_NAMES.get(name)
    if other is None:
        return None
    if other.startswith("!"):  # nothing to set in lightlike for it
        return f"not a lightlike setting: {other[1:]}"
    main, _, note = other.partition(" (") if not other.startswith("fit(") else (other, "", "")
    note = note.removesuffix(")")
    if flag:
        alts = ["--resume"] if main.startswith("fit(") else \
            ["--" + a.strip().replace("='", " ").rstrip("'") for a in main.split(" or ")]
        main = " or ".join(alts)
    text = repr(main) if main.lstrip("-").isidentifier() else main
    return f"did you mean {text}?" + (f" {note}" if note else "")



def read_if_path(path_or_text: str | Path) -> str:
    if isinstance(path_or_text, Path):
        return path_or_text.read_text()
    s = str(path_or_text)
    if "\n" not in s and Path(s).is_file():
        return Path(s).read_text()
    return s


def plain_value(v: Any, leaf: Any = None, key: Any = None) -> Any:
    """``v`` in the forms TOML, YAML and JSON have: paths as their text, enums as their values,
    sets (sorted, where they sort) and tuples as lists, inside lists and dicts too (``lightlike
    config`` and a checkpoint's hparams.json; both read back through the annotations). ``leaf``
    and ``key``, where given, map every other value and every dict key."""
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (set, frozenset)):
        items = [plain_value(x, leaf, key) for x in v]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(v, (list, tuple)):
        return [plain_value(x, leaf, key) for x in v]
    if isinstance(v, dict):
        return {(key(k) if key else k): plain_value(x, leaf, key) for k, x in v.items()}
    return leaf(v) if leaf else v


def _toml_str(s: str) -> str:
    # JSON escapes every control character but DEL, which TOML also refuses raw; ensure_ascii=False
    # because a JSON \ud83d escape of a non-BMP character is not TOML
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(v: Any) -> str:
    """One value as TOML (``FitConfig.to_toml`` and ``lightlike config``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_str(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {v!r} to TOML: write JSON or YAML instead (lightlike config --format json|yaml)")

"""The DeepSpeed config that lightlike generates, and how a user's config is merged into it.

lightlike keeps the loop, so the values the loop decides are generated from the ``FitConfig``
and the precision plugin, and a user config (a dict or a JSON file, e.g. one of the presets in
the top-level ``strategies/`` folder) may add DeepSpeed settings but not contradict them:

=====================================  ========================================================
``train_micro_batch_size_per_gpu``     ``batch_size``
``gradient_accumulation_steps``        ``grad_accum_steps``
``train_batch_size``                   ``batch_size * grad_accum_steps * world_size``
``gradient_clipping``                  ``max_grad_norm`` (0: no clipping)
``zero_optimization.stage``            the strategy's ``stage``
``zero_optimization.offload_*.device`` ``"cpu"`` (or the config's ``"nvme"``) when offloading
``bf16`` / ``fp16`` / ``torch_autocast``  from the precision plugin (see ``precision_sections``)
=====================================  ========================================================

A user value ``"auto"`` means "lightlike fills it in". A user value that differs from the
generated one is a ``ConfigError`` naming the key and both values. ``optimizer`` and
``scheduler`` sections are refused: lightlike builds both (``FitConfig.optimizer``,
``lr_scheduler``) and steps the scheduler itself. So are ``zero_optimization.compute_grad_norm``
and ``bf16.check_grad_overflow`` set to false: DeepSpeed's step is where a NaN/inf gradient norm
is caught (``UNCHECKED``).

This module does not import DeepSpeed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightlike.errors import ConfigError

#: the registered preset names and the strategy settings each stands for
PRESETS: dict[str, dict[str, Any]] = {
    "deepspeed_zero1": {"stage": 1, "offload_optimizer": False, "offload_params": False},
    "deepspeed_zero2": {"stage": 2, "offload_optimizer": False, "offload_params": False},
    "deepspeed_zero2_offload": {"stage": 2, "offload_optimizer": True, "offload_params": False},
    "deepspeed_zero3": {"stage": 3, "offload_optimizer": False, "offload_params": False},
    "deepspeed_zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}

#: sections lightlike owns outright
REFUSED = {
    "optimizer": "lightlike builds the optimizer (FitConfig.optimizer, learning_rate, weight_decay, ... or "
                 "TaskModule.configure_optimizers)",
    "scheduler": "lightlike builds and steps the LR scheduler (FitConfig.lr_scheduler, warmup_steps, ...)",
}

#: settings that make DeepSpeed step with a NaN/inf gradient norm, or not compute the norm
UNCHECKED = (("zero_optimization", "compute_grad_norm"), ("bf16", "check_grad_overflow"))

AUTO = "auto"
_OFFLOAD_DEVICES = ("cpu", "nvme")


def load_user_config(config: Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """A deep copy of a dict config, or the parsed JSON file at a path; {} for None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"DeepSpeed config file {str(config)!r} does not exist")
        try:
            loaded = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"DeepSpeed config file {str(config)!r} is not valid JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"DeepSpeed config file {str(config)!r} must hold a JSON object")
        return loaded
    raise ConfigError(f"config must be a dict or the path of a DeepSpeed JSON file, got {type(config).__name__}")


def check_refused(user: Mapping[str, Any], source: str) -> None:
    for key, why in REFUSED.items():
        if key in user:
            raise ConfigError(f"the DeepSpeed config ({source}) has an {key!r} section, which lightlike does not "
                              f"pass to DeepSpeed: {why}. Remove {key!r} from the config.")


def strategy_settings(user: Mapping[str, Any], stage: int | None, offload_optimizer: bool | None,
                      offload_params: bool | None, source: str) -> tuple[int, str | None, str | None]:
    """Stage and offload devices (None: no offload) from the keyword arguments, else the user
    config, else stage 2 without offload. An argument that contradicts the config is an error
    naming both. Offloading means ``"cpu"`` unless the user config says ``"nvme"``."""
    zero = user.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero_optimization in the DeepSpeed config ({source}) must be an object")
    cfg_stage = zero.get("stage", AUTO)
    dev_opt = _offload_device(zero, "offload_optimizer", source)
    dev_par = _offload_device(zero, "offload_param", source)
    cfg_opt = None if dev_opt == AUTO else dev_opt is not None
    cfg_par = None if dev_par == AUTO else dev_par is not None
    pairs = (("stage", stage, None if cfg_stage == AUTO else cfg_stage, "zero_optimization.stage"),
             ("offload_optimizer", offload_optimizer, cfg_opt, "zero_optimization.offload_optimizer"),
             ("offload_params", offload_params, cfg_par, "zero_optimization.offload_param"))
    for arg, given, in_cfg, key in pairs:
        if given is not None and in_cfg is not None and given != in_cfg:
            raise ConfigError(f"DeepSpeedStrategy({arg}={given!r}) contradicts {key} in the DeepSpeed config "
                              f"({source}), which means {arg}={in_cfg!r}; drop one of them")
    stage_ = stage if stage is not None else (cfg_stage if cfg_stage != AUTO else 2)
    opt = offload_optimizer if offload_optimizer is not None else bool(cfg_opt)
    par = offload_params if offload_params is not None else bool(cfg_par)
    if stage_ not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed ZeRO stage must be 1, 2 or 3, got {stage_!r} (stage 0 is plain data "
                          "parallelism: use strategy='ddp')")
    if par and stage_ != 3:
        raise ConfigError(f"offload_params=True needs ZeRO stage 3 (parameters are partitioned only there), "
                          f"got stage={stage_}")
    return stage_, _device(opt, dev_opt), _device(par, dev_par)


def _device(on: bool, configured: str | None) -> str | None:
    if not on:
        return None
    return configured if configured in _OFFLOAD_DEVICES else "cpu"


def _offload_device(zero: Mapping[str, Any], key: str, source: str) -> str | None:
    """'cpu'/'nvme' when the user config offloads, None when it says 'none', "auto" when it is silent."""
    section = zero.get(key)
    if section is None:
        return AUTO
    device = section.get("device", AUTO) if isinstance(section, Mapping) else section
    if device == AUTO:
        return AUTO
    if device in (None, "none"):
        return None
    if device in _OFFLOAD_DEVICES:
        return str(device)
    raise ConfigError(f"zero_optimization.{key}.device in the DeepSpeed config ({source}) must be 'cpu', 'nvme' "
                      f"or 'none', got {device!r}")


def precision_sections(precision_name: str, fp16_ok: bool, device: str, strategy: str) -> dict[str, Any]:
    """How lightlike's precision plugins map onto DeepSpeed (every section stated, so a user
    config that switches one on where lightlike does not is caught):

    - ``32-true``: no low precision anywhere.
    - ``bf16-mixed``: DeepSpeed's ``torch_autocast`` section: fp32 parameters and fp32 master
      weights (ZeRO keeps one fp32 copy), forward under ``torch.autocast`` (the plugin's autocast
      around the loss stays on as well); gradients of autocast-safe layers (Linear, Conv) are
      reduced in the low dtype, DeepSpeed's choice for this mode.
    - ``16-mixed``: refused. DeepSpeed 0.19.8's ``torch_autocast`` float16 path scales the loss
      with a ``GradScaler`` whose ``update()`` its ZeRO ``step()`` skips on overflow (the scale
      never drops: every later step is skipped) and clips the still-scaled gradients (updates
      ~1e4 times too small); ``16-true`` (DeepSpeed's ``fp16`` section, its own dynamic loss
      scaler, fp32 master weights) or ``bf16-mixed`` train correctly.
    - ``bf16-true`` / ``16-true``: DeepSpeed's ``bf16`` / ``fp16`` sections: parameters and compute
      in the half dtype, fp32 master weights and optimizer state in the ZeRO partitions (DeepSpeed's
      standard mode; unlike lightlike's own ``*-true`` plugins it keeps an fp32 copy, sharded);
      ``fp16`` with DeepSpeed's dynamic loss scaling unless the user config sets ``loss_scale``.
    - float16 on a device where DeepSpeed's accelerator has no float16 support (this CPU) is an error.
    """
    off = {"bf16": {"enabled": False}, "fp16": {"enabled": False}, "torch_autocast": {"enabled": False}}
    if precision_name == "32-true":
        return off
    if precision_name.startswith("16-") and not fp16_ok:
        raise ConfigError(f"precision={precision_name!r} with strategy={strategy!r}: DeepSpeed has no float16 "
                          f"support on this device ({device}); use precision='bf16-mixed', 'bf16-true' or "
                          "'32-true'")
    if precision_name == "16-mixed":
        raise ConfigError(f"precision='16-mixed' with strategy={strategy!r}: DeepSpeed's float16 autocast path never "
                          "lowers its loss scale after an overflow and clips scaled gradients (DeepSpeed 0.19.8); "
                          "use precision='16-true' (DeepSpeed's fp16 mode: fp32 master weights, its own dynamic "
                          "loss scaling) or 'bf16-mixed'")
    if precision_name == "bf16-mixed":
        return {**off, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if precision_name == "bf16-true":
        return {**off, "bf16": {"enabled": True}}
    if precision_name == "16-true":
        return {**off, "fp16": {"enabled": True}}
    raise ConfigError(f"precision={precision_name!r} has no DeepSpeed mapping (strategy={strategy!r}); use "
                      "'32-true', 'bf16-mixed', 'bf16-true' or '16-true'")


def generated_config(*, batch_size: int, grad_accum_steps: int, world_size: int, max_grad_norm: float | None,
                     stage: int, offload_optimizer: str | None, offload_params: str | None,
                     precision: Mapping[str, Any]) -> dict[str, Any]:
    """The values lightlike decides (the table in the module docstring); offloads are devices."""
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer}
    if offload_params:
        zero["offload_param"] = {"device": offload_params}
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": batch_size * grad_accum_steps * world_size,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "zero_optimization": zero,
        **copy.deepcopy(dict(precision)),
    }


#: defaults lightlike adds when the user config does not set them (not owned: a user may change them)
DEFAULTS: dict[str, Any] = {
    # lightlike passes a torch optimizer (AdamW/SGD or the module's own): allow it under ZeRO, and
    # under ZeRO-Offload too (DeepSpeed would otherwise insist on its DeepSpeedCPUAdam)
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "steps_per_print": 2**31 - 1,  # lightlike logs; DeepSpeed's own progress lines would repeat it
    "wall_clock_breakdown": False,
}


def merge(generated: Mapping[str, Any], user: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``user`` with ``generated`` filled in: "auto" and absent values take the generated value,
    equal values pass, different ones raise; keys only the user sets are kept."""
    out = copy.deepcopy(dict(user))
    _merge_into(out, generated, source, prefix="")
    zero = out["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):  # no offload: drop a "none"/"auto" section
        if key not in generated["zero_optimization"]:
            zero.pop(key, None)
    for k, v in DEFAULTS.items():
        out.setdefault(k, v)
    for section, key in UNCHECKED:
        if isinstance(out.get(section), Mapping) and out[section].get(key) is False:
            raise ConfigError(f"{section}.{key}=false in the DeepSpeed config ({source}): DeepSpeed would then step "
                              "with a gradient whose norm is NaN/inf (or compute no norm), which lightlike's "
                              "non-finite check (nonfinite_loss) reads from it; remove the setting")
    left = _auto_keys(out, "")
    if left:
        raise ConfigError(f"the DeepSpeed config ({source}) says \"auto\" for {', '.join(left)}, which lightlike "
                          "does not fill in; give a value")
    return out


def _auto_keys(cfg: Mapping[str, Any], prefix: str) -> list[str]:
    found = []
    for k, v in cfg.items():
        if v == AUTO:
            found.append(f"{prefix}{k}")
        elif isinstance(v, Mapping):
            found += _auto_keys(v, f"{prefix}{k}.")
    return found


def _merge_into(out: dict[str, Any], generated: Mapping[str, Any], source: str, prefix: str) -> None:
    for key, value in generated.items():
        name = f"{prefix}{key}"
        if key not in out or out[key] == AUTO:
            out[key] = copy.deepcopy(value)
        elif isinstance(value, Mapping):
            if not isinstance(out[key], Mapping):
                raise ConfigError(f"{name} in the DeepSpeed config ({source}) must be an object, got {out[key]!r}")
            out[key] = dict(out[key])
            _merge_into(out[key], value, source, prefix=f"{name}.")
            for k in [k for k, v in out[key].items() if v == AUTO and k not in value]:
                del out[key][k]  # a section lightlike decides (off: torch_autocast needs no dtype)
        elif not _same(out[key], value):
            raise ConfigError(f"{name}: the DeepSpeed config ({source}) says {out[key]!r} but lightlike generates "
                              f"{value!r} from its settings ({_origin(name)}); set it there, or use \"auto\" in "
                              "the DeepSpeed config")


_DTYPES = {"bf16": "bfloat16", "torch.bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
           "torch.float16": "float16", "fp32": "float32", "float": "float32", "torch.float32": "float32"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return _DTYPES.get(a, a) == _DTYPES.get(b, b)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return bool(a == b)


_ORIGINS = {
    "train_micro_batch_size_per_gpu": "FitConfig.batch_size",
    "gradient_accumulation_steps": "FitConfig.grad_accum_steps",
    "train_batch_size": "batch_size x grad_accum_steps x world size",
    "gradient_clipping": "FitConfig.max_grad_norm",
    "zero_optimization.stage": "the strategy's stage",
}


def _origin(name: str) -> str:
    if name in _ORIGINS:
        return _ORIGINS[name]
    if name.startswith(("bf16", "fp16", "torch_autocast")):
        return "the precision setting"
    return "the strategy's offload settings"

"""Liger kernels: ``use_liger_kernel=True`` patches a supported ``transformers`` model with
liger-kernel's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross entropy, ...) through
liger-kernel's own ``_apply_liger_kernel_to_instance(model=..., **liger_kernel_config)``, the call
the HF Trainer makes, at the fit's set-up, before the strategy wraps the module. The patch is
liger-kernel's: it changes the model instance in place, and stays after the fit (as under the
Trainer).

Everything that would make it fail is one ``ConfigError`` at set-up, before any step: a module
that holds no ``transformers`` model, a fit that does not run on CUDA, liger-kernel or Triton
missing, a model type liger-kernel has no kernels for (it would silently patch nothing), and a
``liger_kernel_config`` key its apply function for the model does not take (it would silently
drop it).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from lightlike.errors import ConfigError

_SETTINGS = ("use_liger_kernel", "liger_kernel_config")


def liger_model(module: Any) -> Any:
    """The ``transformers`` model Liger patches: the one an ``HFModel``/``HFCausalLM`` holds as
    ``model`` (the base model of a PEFT model), or ``module`` itself; a ``ConfigError`` otherwise."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # no transformers: the module holds no transformers model
        raise _holds_none(module, module) from None
    candidate = module if isinstance(module, PreTrainedModel) else getattr(module, "model", module)
    get_base = getattr(candidate, "get_base_model", None)  # a PeftModel: its transformers model
    if callable(get_base):
        candidate = get_base()
    if not isinstance(candidate, PreTrainedModel):
        raise _holds_none(module, candidate)
    return candidate


def _holds_none(module: Any, candidate: Any) -> ConfigError:
    return ConfigError(
        f"use_liger_kernel=True patches a transformers model, and {type(module).__name__} holds none (its model is a "
        f"{type(candidate).__name__}): wrap the model in lightlike.interop.HFCausalLM or HFModel, or drop "
        "use_liger_kernel", settings=_SETTINGS)


def import_liger() -> Any:
    """``liger_kernel.transformers.monkey_patch`` (liger-kernel's apply functions); a ``ConfigError``
    naming the extra (or Triton) when it is missing."""
    try:
        return importlib.import_module("liger_kernel.transformers.monkey_patch")
    except ImportError as error:
        missing = (getattr(error, "name", None) or "").split(".")[0]
        if missing == "triton":
            raise ConfigError("use_liger_kernel=True: liger-kernel is installed but Triton is not (liger-kernel's "
                              "kernels are Triton kernels): pip install triton, or drop use_liger_kernel",
                              settings=_SETTINGS) from error
        if missing == "liger_kernel":
            raise ConfigError("use_liger_kernel=True needs liger-kernel: pip install 'lightlike[liger]' (on a machine "
                              "with a CUDA GPU), or drop use_liger_kernel", settings=_SETTINGS) from error
        raise ConfigError(f"use_liger_kernel=True: liger-kernel failed to import ({error}): install a liger-kernel "
                          "release made for this transformers, or drop use_liger_kernel", settings=_SETTINGS) from error


def check_liger_config(liger: Any, model: Any, kernel_config: dict[str, Any]) -> None:
    """A ``ConfigError`` where liger-kernel has no kernels for ``model``'s type, or where
    ``kernel_config`` names an argument its apply function for that type does not take."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    table = liger.MODEL_TYPE_TO_APPLY_LIGER_FN
    if model_type not in table:
        raise ConfigError(f"use_liger_kernel=True: liger-kernel has no kernels for model type {model_type!r} "
                          f"({type(model).__name__}); it supports {sorted(table)}. Drop use_liger_kernel",
                          settings=_SETTINGS)
    accepted = set(inspect.signature(table[model_type]).parameters) - {"model"}
    unknown = sorted(set(kernel_config) - accepted)
    if unknown:
        raise ConfigError(f"liger_kernel_config: {unknown} are not arguments of liger-kernel's apply function for "
                          f"{model_type!r} models, which takes {sorted(accepted)}", settings=_SETTINGS)


def apply_liger(module: Any, config: Any, device_type: str) -> None:
    """With ``config.use_liger_kernel``: liger-kernel's kernels applied to the ``transformers``
    model in ``module`` (``liger_model``), whose fit runs on ``device_type``; each reason it
    cannot be is a ``ConfigError``. Without it: nothing."""
    if not config.use_liger_kernel:  # (a liger_kernel_config without it: FitConfig.validate refuses it)
        return
    kernel_config = dict(config.liger_kernel_config or {})
    model = liger_model(module)
    if device_type != "cuda":
        raise ConfigError(f"use_liger_kernel=True: liger-kernel's kernels are Triton kernels for CUDA GPUs, and this "
                          f"fit runs on {device_type!r}: run it on a CUDA device (accelerator='cuda'), or drop "
                          "use_liger_kernel", settings=_SETTINGS)
    liger = import_liger()
    check_liger_config(liger, model, kernel_config)
    liger._apply_liger_kernel_to_instance(model=model, **kernel_config)


__all__ = ["apply_liger", "check_liger_config", "import_liger", "liger_model"]

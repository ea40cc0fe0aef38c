"""The built-in optimizers by name: which class each name is (``torch.optim``'s, or another
library's: ``lightlike.optimizers.libraries``), and the arguments it gets from the ``FitConfig``
fields and ``optimizer_kwargs``.

Every argument is checked against the class's own signature (``inspect.signature``), so a name
the class does not take is one ``ConfigError`` naming the optimizer and the arguments it does
take, at ``FitConfig`` construction, rather than torch's ``TypeError`` at set-up. The fields
keep their meaning for every class that takes the argument they set: ``adam_beta1``/``adam_beta2``
and ``adam_epsilon`` are ``betas``/``eps`` of the Adam family (the classes that take ``betas``),
``momentum`` is ``momentum`` of SGD and RMSprop, ``fused`` is ``fused`` wherever torch has the
kernel. A field set away from its default for a class that does not take its argument is an
error, and so is one value given twice (a field set and the same argument in
``optimizer_kwargs``): silently dropping either would train with a setting the user did not ask
for. ``lr`` and ``weight_decay`` come from ``learning_rate`` and ``weight_decay`` only, because
weight decay is per parameter group (``lightlike.optim.param_groups``: none on biases and norms).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lightlike.errors import ConfigError
from lightlike.optimizers.libraries import LIBRARY_OPTIMIZERS, REFUSED, library_class, parse_optim_args

__all__ = ["OPTIMIZER_CLASSES", "LIBRARY_OPTIMIZERS", "optimizer_class", "arguments_of", "check_optimizer_kwargs",
           "optimizer_arguments", "parse_optim_args", "GALORE_ARGUMENTS"]

#: name -> (the torch.optim class's name, the arguments the name itself fixes); ``adamw_torch`` and
#: ``adamw_torch_fused`` are the HF Trainer's names for AdamW and its fused kernel
OPTIMIZER_CLASSES: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("AdamW", {}), "adamw_torch": ("AdamW", {}), "adamw_torch_fused": ("AdamW", {"fused": True}),
    "adam": ("Adam", {}), "sgd": ("SGD", {}), "adafactor": ("Adafactor", {}), "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}), "nadam": ("NAdam", {}), "radam": ("RAdam", {}),
}
#: arguments that FitConfig fields (or the parameter groups) give, never optimizer_kwargs
_OWN_FIELDS = {"params": "the module's parameters (param_groups)", "lr": "learning_rate",
               "weight_decay": "weight_decay (no decay on biases and norms, per parameter group)"}
#: GaLore's arguments of the projected parameter group (the HF Trainer's defaults), given in optimizer_kwargs
GALORE_ARGUMENTS = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
#: LOMO's arguments that FitConfig fields give
_LOMO_FIELDS = {"model": "the module", "clip_grad_norm": "max_grad_norm", "clip_grad_value": "max_grad_value"}
#: classes that get torch's fused kernel by default (``fused=None``) on the devices in FUSED_DEVICES
AUTO_FUSED = ("AdamW", "Adam")
FUSED_DEVICES = ("cuda", "cpu")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class the built-in optimizer ``name`` is (another library's is imported now)."""
    if name in REFUSED:
        raise ConfigError(f"optimizer={name!r} is not offered: {REFUSED[name]}", settings=("optimizer",))
    if name in LIBRARY_OPTIMIZERS:
        return library_class(name)
    if name not in OPTIMIZER_CLASSES:
        raise ConfigError(f"optimizer={name!r} is not valid; choose one of: {', '.join(OPTIMIZER_CLASSES)}",
                          settings=("optimizer",))
    cls = getattr(torch.optim, OPTIMIZER_CLASSES[name][0], None)
    if cls is None:  # torch.optim.Adafactor came with torch 2.5
        raise ConfigError(f"optimizer={name!r} needs torch.optim.{OPTIMIZER_CLASSES[name][0]}, which torch "
                          f"{torch.__version__} does not have: upgrade torch or choose another optimizer",
                          settings=("optimizer",))
    return cls


def arguments_of(cls: type, name: str | None = None) -> list[str]:
    """The arguments ``optimizer_kwargs`` may give ``cls``: its signature's, less ``_OWN_FIELDS``
    (and LOMO's ``_LOMO_FIELDS``), with GaLore's ``GALORE_ARGUMENTS`` for a GaLore ``name``."""
    family = LIBRARY_OPTIMIZERS[name].family if name in LIBRARY_OPTIMIZERS else None
    own = {**_OWN_FIELDS, **(_LOMO_FIELDS if family == "lomo" else {})}
    return [p for p in inspect.signature(cls).parameters if p not in own] + \
        (list(GALORE_ARGUMENTS) if family == "galore" else [])


def fixed_arguments(name: str) -> dict[str, Any]:
    """The arguments the name ``name`` itself fixes (``adamw_torch_fused``'s fused, bitsandbytes' bits)."""
    return dict(LIBRARY_OPTIMIZERS[name].fixed) if name in LIBRARY_OPTIMIZERS else dict(OPTIMIZER_CLASSES[name][1])


def class_label(name: str, cls: type) -> str:
    """``optimizer='name' (module.Class)`` for messages."""
    where = LIBRARY_OPTIMIZERS[name].module if name in LIBRARY_OPTIMIZERS else "torch.optim"
    return f"optimizer={name!r} ({where}.{cls.__name__})"


def check_optimizer_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """``optimizer_kwargs`` for the optimizer ``name``: every key an argument its class takes
    (one error listing every bad key and the valid ones), and none that the name fixes."""
    if name in REFUSED or name in LIBRARY_OPTIMIZERS:
        cls = optimizer_class(name)  # the library imported now: a missing one is named before any fit
    if (name not in OPTIMIZER_CLASSES and name not in LIBRARY_OPTIMIZERS) or not kwargs:
        return
    cls = optimizer_class(name)
    valid = arguments_of(cls, name)
    what = class_label(name, cls)
    fields_of = {**_OWN_FIELDS, **(_LOMO_FIELDS if name in ("lomo", "adalomo") else {})}
    own = [f"{k!r} (set {fields_of[k]})" for k in kwargs if k in fields_of]
    unknown = [repr(k) for k in kwargs if k not in fields_of and k not in valid]
    if own or unknown:
        parts = ([f"takes no argument {', '.join(unknown)}"] if unknown else []) + \
                ([f"gets {', '.join(own)} from the config fields, not optimizer_kwargs"] if own else [])
        raise ConfigError(f"optimizer_kwargs: {what} {'; '.join(parts)}. Its arguments: {', '.join(valid)}",
                          settings=("optimizer_kwargs",))
    for key, value in fixed_arguments(name).items():
        if key in kwargs and kwargs[key] != value:
            raise ConfigError(f"optimizer_kwargs: {name!r} is {cls.__name__} with {key}={value!r}; "
                              f"{key}={kwargs[key]!r} contradicts it: "
                              + ("use optimizer='adamw' for that" if name in OPTIMIZER_CLASSES else
                                 "choose the name that has it (docs/optimizers.md lists them)"),
                              settings=("optimizer_kwargs", "optimizer"))


def optimizer_arguments(config: Any, params: list[torch.Tensor]) -> dict[str, Any]:
    """The arguments, besides the parameter groups and ``lr``, that the built-in optimizer gets:
    the fields that apply to its class, then ``optimizer_kwargs`` (see the module docstring).
    ``params``: the parameters, on their devices (for ``fused=None``). GaLore's group arguments
    (``GALORE_ARGUMENTS``) are in it: ``lightlike.optimizers.galore`` takes them out."""
    name, kwargs = config.optimizer, dict(config.optimizer_kwargs)
    cls = optimizer_class(name)
    check_optimizer_kwargs(name, kwargs)
    takes = set(arguments_of(cls, name))
    what = class_label(name, cls)
    entry = LIBRARY_OPTIMIZERS.get(name)
    out: dict[str, Any] = {**(entry.defaults if entry else {}), **fixed_arguments(name)}
    betas_set = (config.adam_beta1, config.adam_beta2) != (0.9, 0.999)
    eps_set = config.adam_epsilon != 1e-8
    if "betas" in takes:
        out["betas"] = (config.adam_beta1, config.adam_beta2)
        if "eps" in takes:
            out["eps"] = config.adam_epsilon
        elif eps_set:
            raise ConfigError(f"adam_epsilon={config.adam_epsilon!r}: {what} takes no eps; drop it",
                              settings=("adam_epsilon",))
    else:
        given = [f"{f}={getattr(config, f)!r}" for f, default in
                 (("adam_beta1", 0.9), ("adam_beta2", 0.999), ("adam_epsilon", 1e-8)) if getattr(config, f) != default]
        if given:
            raise ConfigError(f"{', '.join(given)}: {what} takes no betas; adam_beta1, adam_beta2 and adam_epsilon "
                              "set the Adam family (adamw, adam, nadam, radam, ...): drop them, or give the class's own "
                              f"arguments in optimizer_kwargs ({', '.join(sorted(takes))})",
                              settings=("adam_beta1", "adam_beta2", "adam_epsilon"))
    if "momentum" in takes:
        if config.momentum != 0.0 or not (entry and entry.family == "schedule_free"):  # (its own default: 0.9)
            out["momentum"] = config.momentum
    elif config.momentum != 0.0:
        betas = ", or adam_beta1 for its momentum" if "betas" in takes else ""
        raise ConfigError(f"momentum={config.momentum} is an SGD setting and {what} ignores it: use optimizer='sgd' "
                          f"or 'rmsprop'{betas}", settings=("momentum",))
    out.update(_fused(config, cls, what, takes, params))
    for key, field, is_set in (("betas", "adam_beta1/adam_beta2", betas_set),
                               ("eps", "adam_epsilon", eps_set and "betas" in takes),
                               ("momentum", "momentum", config.momentum != 0.0),
                               ("fused", "fused", config.fused is not None)):
        if key in kwargs and is_set:
            raise ConfigError(f"{key} is given twice: optimizer_kwargs[{key!r}]={kwargs[key]!r} and the field "
                              f"{field}; set one of them", settings=("optimizer_kwargs", field.split("/")[0]))
    return {**out, **kwargs}


def _fused(config: Any, cls: type, what: str, takes: set[str], params: list[torch.Tensor]) -> dict[str, Any]:
    """``fused``: True is passed where the class has the kernel (an error elsewhere); None passes
    True for ``AUTO_FUSED`` classes when every parameter is a floating tensor on a device with the
    kernel (one kernel per parameter instead of about ten element-wise ops); False passes nothing."""
    if config.fused is False and fixed_arguments(config.optimizer).get("fused"):
        raise ConfigError(f"fused=False contradicts optimizer={config.optimizer!r} (AdamW's fused kernel): use "
                          "optimizer='adamw' with fused=False", settings=("fused", "optimizer"))
    if config.fused is True:
        if "fused" not in takes:
            raise ConfigError(f"fused=True: {what} has no fused kernel (torch.optim's AdamW, Adam, SGD and Adagrad "
                              "have one); drop it", settings=("fused",))
        return {"fused": True}
    if config.fused is None and cls.__name__ in AUTO_FUSED and "fused" in takes and cls.__module__.startswith(
            "torch.optim") and "fused" not in config.optimizer_kwargs \
            and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params):
        return {"fused": True}
    return {}

"""The optimizers of other libraries by the HF Trainer's names: which class each name is, from
which optional extra, and what the name fixes.

Nothing here imports a library at ``import lightlike``: ``library_class`` imports the one a name
needs when a ``FitConfig`` naming it is checked or its optimizer is built; a library that is not
installed is one ``ConfigError`` naming the extra to install. A CUDA-only optimizer (bitsandbytes'
paged ones, GaLore's 8-bit AdamW) on a run without CUDA is one ``ConfigError`` at set-up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from lightlike.errors import ConfigError


@dataclass(frozen=True)
class LibraryOptimizer:
    """One name: the class ``module.cls`` of the extra ``extra``; ``fixed``: arguments the name
    sets (a different value in ``optimizer_kwargs`` is an error); ``defaults``: arguments the HF
    Trainer passes unless told otherwise (``optimizer_kwargs`` may change them); ``family``: how
    lightlike builds it (``"plain"``, ``"galore"``, ``"schedule_free"``, ``"lomo"``)."""
    module: str
    cls: str
    extra: str
    fixed: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    family: str = "plain"
    cuda_only: bool = False


def _bnb(cls: str, bits: int, paged: bool) -> LibraryOptimizer:
    return LibraryOptimizer("bitsandbytes.optim", cls, "bnb", fixed={"optim_bits": bits, "is_paged": paged},
                            cuda_only=paged)


#: the Trainer's extra arguments of torchao's low-bit AdamW (``block_size`` 256 for both)
_TORCHAO = {"block_size": 256, "bf16_stochastic_round": False}
#: the Trainer's extra arguments of schedule-free optimizers
_SCHEDULE_FREE = {"weight_lr_power": 2.0, "r": 0.0}

LIBRARY_OPTIMIZERS: dict[str, LibraryOptimizer] = {
    "galore_adamw": LibraryOptimizer("galore_torch", "GaLoreAdamW", "galore", family="galore"),
    "galore_adamw_8bit": LibraryOptimizer("galore_torch", "GaLoreAdamW8bit", "galore", family="galore",
                                          cuda_only=True),
    "galore_adafactor": LibraryOptimizer("galore_torch", "GaLoreAdafactor", "galore", family="galore",
                                         fixed={"scale_parameter": False, "relative_step": False}),
    "adamw_bnb_8bit": _bnb("AdamW", 8, False), "adamw_8bit": _bnb("AdamW", 8, False),
    "paged_adamw_8bit": _bnb("AdamW", 8, True), "paged_adamw_32bit": _bnb("AdamW", 32, True),
    "lion_8bit": _bnb("Lion", 8, False), "lion_32bit": _bnb("Lion", 32, False),
    "paged_lion_8bit": _bnb("Lion", 8, True), "paged_lion_32bit": _bnb("Lion", 32, True),
    "adamw_torch_8bit": LibraryOptimizer("torchao.optim", "AdamW8bit", "torchao", defaults=_TORCHAO),
    "adamw_torch_4bit": LibraryOptimizer("torchao.optim", "AdamW4bit", "torchao", defaults=_TORCHAO),
    "schedule_free_adamw": LibraryOptimizer("schedulefree", "AdamWScheduleFree", "schedulefree",
                                            defaults=_SCHEDULE_FREE, family="schedule_free"),
    "schedule_free_sgd": LibraryOptimizer("schedulefree", "SGDScheduleFree", "schedulefree",
                                          defaults=_SCHEDULE_FREE, family="schedule_free"),
    "schedule_free_radam": LibraryOptimizer("schedulefree", "RAdamScheduleFree", "schedulefree",
                                            defaults=_SCHEDULE_FREE, family="schedule_free"),
    "lomo": LibraryOptimizer("lomo_optim", "Lomo", "lomo", family="lomo"),
    "adalomo": LibraryOptimizer("lomo_optim", "AdaLomo", "lomo", family="lomo", cuda_only=True),  # (its state: .cuda())
}

#: names refused by name, with the reason (the HF Trainer offers them)
REFUSED: dict[str, str] = {
    name: ("GaLore's layer-wise form steps one optimizer per parameter inside backward (a post-accumulate-grad "
           "hook), so lightlike's guarantees cannot hold for it: no global gradient clipping or non-finite check "
           "before the update, no gradient accumulation (the Trainer refuses it too), no DDP (the Trainer refuses "
           "it too), and a dict of optimizers the checkpoint does not resume. Use "
           f"optimizer={name.removesuffix('_layerwise')!r} (the same update, all parameters at once)")
    for name in ("galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise")
}


def library_class(name: str) -> type:
    """The class of the optimizer ``name`` (``LIBRARY_OPTIMIZERS``), imported now; a library
    that is not installed is a ``ConfigError`` naming the extra."""
    entry = LIBRARY_OPTIMIZERS[name]
    try:
        module = importlib.import_module(entry.module)
    except ImportError as e:
        raise ConfigError(f"optimizer={name!r} needs {entry.module.split('.')[0]} ({e}): "
                          f"pip install 'lightlike[{entry.extra}]'", settings=("optimizer",)) from None
    cls = getattr(module, entry.cls, None)
    if cls is None:
        raise ConfigError(f"optimizer={name!r} needs {entry.module}.{entry.cls}, which the installed "
                          f"{entry.module.split('.')[0]} lacks: pip install -U 'lightlike[{entry.extra}]'",
                          settings=("optimizer",))
    return cls


def check_device(name: str, device: Any) -> None:
    """A CUDA-only optimizer on a run whose device is not CUDA: one ``ConfigError`` at set-up."""
    entry = LIBRARY_OPTIMIZERS.get(name)
    if entry is not None and entry.cuda_only and getattr(device, "type", str(device)) != "cuda":
        raise ConfigError(f"optimizer={name!r} ({entry.module}.{entry.cls}) runs on CUDA only, and this run's "
                          f"device is {device}: run on a GPU, or choose "
                          "an optimizer that runs on the CPU (adamw_8bit, lion_8bit, adamw_torch_8bit, "
                          "galore_adamw, ...)", settings=("optimizer", "accelerator"))


def parse_optim_args(text: str) -> dict[str, Any]:
    """The HF Trainer's ``optim_args`` string ``"k=v,k2=v2"`` (spaces ignored, as the Trainer
    does) as a dict: each value an int, a float, True/False (``true``/``false``), or the text."""
    out: dict[str, Any] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key or "=" in value:
            raise ConfigError(f"optimizer_kwargs={text!r}: {item!r} is not key=value; write 'k=v,k2=v2' (the HF "
                              "Trainer's optim_args) or a dict", settings=("optimizer_kwargs",))
        out[key] = _value(value)
    return out


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text

"""Strategies, by registered name or instance. Only this package knows strategy types."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.strategies.base import Strategy, move_to_device
from lightlike.strategies.environment import detect_environment
from lightlike.strategies.single import SingleDeviceStrategy

StrategyFactory = Callable[[str, Precision], Strategy]

def _ddp(accelerator: str, precision: Precision) -> Strategy:
    from lightlike.strategies.ddp import DDPStrategy

    return DDPStrategy(accelerator, precision)


def _preset(module: str, cls: str, name: str) -> StrategyFactory:
    """A factory that imports ``lightlike.strategies.<module>`` only when the name is used
    (DeepSpeed and DCP are heavy imports) and builds ``<cls>.from_preset(name, ...)``."""
    def build(accelerator: str, precision: Precision) -> Strategy:
        import importlib

        klass = getattr(importlib.import_module(f"lightlike.strategies.{module}"), cls)
        return klass.from_preset(name, accelerator=accelerator, precision=precision)

    return build


STRATEGIES: dict[str, StrategyFactory] = {
    "single": lambda accelerator, precision: SingleDeviceStrategy(accelerator, precision),
    "ddp": _ddp,
    **{name: _preset("fsdp", "FSDPStrategy", name) for name in ("fsdp", "fsdp_offload", "hsdp")},
    **{name: _preset("deepspeed", "DeepSpeedStrategy", name)
       for name in ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3",
                    "deepspeed_zero3_offload")},
}


def get_strategy(spec: str | Strategy, accelerator: str, precision: Precision | None) -> Strategy:
    """A ``Strategy`` from a registered name, a preset file (``.toml``: FSDP, ``.json``: DeepSpeed)
    or an instance. ``'auto'``: one process → single.

    ``precision=None`` (the user said ``'auto'``) keeps an instance's own precision plugin."""
    if isinstance(spec, Strategy):
        if precision is not None:
            spec.precision = precision
        return spec
    precision = precision if precision is not None else Precision()
    if not isinstance(spec, str):
        raise ConfigError(f"strategy must be a name or a Strategy instance, got {type(spec).__name__}")
    if spec.endswith((".toml", ".json")):
        return _from_file(spec, accelerator, precision)
    name = spec
    if name == "auto":
        name = "single" if detect_environment().world_size == 1 else "ddp"
    if name not in STRATEGIES:
        close = difflib.get_close_matches(name, list(STRATEGIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown strategy {spec!r}{hint}; valid names: {', '.join(['auto', *STRATEGIES])}")
    return STRATEGIES[name](accelerator, precision)


def _from_file(path: str, accelerator: str, precision: Precision) -> Strategy:
    """A preset file as the strategy: ``.toml`` an FSDP preset (``strategies/fsdp.toml``), ``.json``
    a DeepSpeed config (``strategies/deepspeed_zero3.json``); so config files and the command line
    can name one."""
    from pathlib import Path

    if not Path(path).is_file():
        raise ConfigError(f"strategy={path!r}: no such file (a .toml FSDP preset or a .json DeepSpeed config)")
    if path.endswith(".toml"):
        from lightlike.strategies.fsdp import FSDPStrategy

        return FSDPStrategy.from_file(path, accelerator=accelerator, precision=precision)
    from lightlike.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(accelerator, precision, config=path)


__all__ = ["STRATEGIES", "SingleDeviceStrategy", "Strategy", "get_strategy", "move_to_device"]

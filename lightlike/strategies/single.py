"""One process, one device."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.precision.base import NO_CONTEXT
from lightlike.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Everything on one device: ``cpu``, ``cuda`` or ``cuda:N``. ``activation_checkpointing=True``
    checkpoints each of the module's repeated blocks (found as for ``compile_regions``:
    ``lightlike.blocks.find_blocks``), as FSDP checkpoints its shard units: their activations
    are recomputed in backward instead of kept. With ``compile=True`` too (whole step or
    ``compile_regions``): the checkpoint is then traced into the compiled graphs
    (``lightlike.blocks.checkpoint_blocks``)."""

    name = "single"
    _plain_gradients = True

    def __init__(self, accelerator: str = "auto", precision: Precision | None = None, *,
                 activation_checkpointing: bool = False) -> None:
        super().__init__(accelerator, precision)
        self.root_device = resolve_device(accelerator)
        self.activation_checkpointing = activation_checkpointing
        self.compiled = False  # compile=True: the blocks are checkpointed in the form torch.compile traces

    def configure(self, config: Any) -> None:
        self.compiled = bool(getattr(config, "compile", False))

    def setup_environment(self) -> None:
        import os

        from lightlike.strategies.environment import detect_environment

        world = os.environ.get("WORLD_SIZE", "").strip()
        if world.isdigit() and int(world) > 1:  # checked first: detect_environment names only the missing ranks
            raise ConfigError(
                f"strategy='single' but WORLD_SIZE={world}: this process says it is one of {world}; use "
                "strategy='ddp' (or 'auto') under a launcher, or unset WORLD_SIZE to run one process"
            )
        env = detect_environment()
        if env.world_size > 1:
            what = "WORLD_SIZE" if env.kind == "torchrun" else next(
                n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if n in os.environ)
            raise ConfigError(
                f"strategy='single' but {what}={env.world_size}: this process was launched as one of "
                f"{env.world_size}; use strategy='ddp' (or 'auto'), or launch a single process"
            )
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        self.precision.setup(self.root_device)

    def setup_module(self, module: nn.Module, manual: bool = False) -> nn.Module:
        # (manual optimization: the same; one process, nothing to average)
        module = self.precision.convert_module(module).to(self.root_device)
        if self.activation_checkpointing:
            from lightlike.blocks import checkpoint_blocks, find_blocks

            checkpoint_blocks(module, find_blocks(module), compiled=self.compiled)
            if hasattr(module, "gradient_checkpointing_disable"):  # checkpointed here, so not twice
                module.gradient_checkpointing_disable()
            self.checkpoints_activations = True
        return module

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return NO_CONTEXT  # no other rank to synchronise with


def resolve_device(accelerator: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU. Devices that do not exist are an error."""
    if accelerator == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(accelerator)
    except RuntimeError as e:
        raise ConfigError(f"accelerator={accelerator!r} is not a device; use 'auto', 'cpu' or 'cuda'") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"accelerator={accelerator!r} but CUDA is not available here; use 'cpu' or 'auto'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"accelerator={accelerator!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ConfigError(f"accelerator={accelerator!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    return device

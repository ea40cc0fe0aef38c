"""One process, one device."""

from __future__ import annotations

import torch

from lightlike.errors import ConfigError
from lightlike.precision import Precision
from lightlike.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Everything on one device: ``cpu``, ``cuda`` or ``cuda:N``."""

    name = "single"

    def __init__(self, accelerator: str = "auto", precision: Precision | None = None) -> None:
        super().__init__(accelerator, precision)
        self.root_device = resolve_device(accelerator)

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
        super().setup_environment()


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

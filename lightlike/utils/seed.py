"""Seeding and RNG state capture, for reproducible runs and bit-exact resume."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device); ``deterministic``: switch torch's
    deterministic algorithms on for the process (the Fitter uses ``deterministic_mode`` instead,
    for its fits only)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        _switch_deterministic_on()


def _switch_deterministic_on() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """torch's deterministic algorithms (and no cuDNN benchmarking) for the block when
    ``enabled``; as they were after it. (Left on for the process, a later fit without
    ``deterministic`` ran deterministically too.) Not enabled: nothing is touched."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    _switch_deterministic_on()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
        if before[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def rng_state() -> dict[str, Any]:
    """The state of every RNG the loop can touch, on this process."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_device"] = torch.cuda.current_device()  # the one this process computes on
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        _set_cuda_rng_state(list(state["cuda"]), state.get("cuda_device"))


def _set_cuda_rng_state(saved: list[torch.Tensor], device: int | None) -> None:
    """Every GPU's generator as saved where this process sees as many GPUs as the one that saved
    them. Where it sees another number (resumed under another launcher or allocation: SLURM's one
    GPU per task against torchrun's whole node, say), ``set_rng_state_all`` failed on a device that
    does not exist, or left the GPU computed on with another GPU's stream: the saved state of the
    GPU the saving process computed on goes to the one this process computes on. (Checkpoints of
    before 2026-11-27 do not name it: a rank of a process that saw its whole node computed on
    ``cuda:LOCAL_RANK``.)"""
    if len(saved) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved)
        return
    if device is None:
        device = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_rng_state(saved[min(device, len(saved) - 1)])  # into the current device


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Every random stream ``rng_state`` captures is as it was before the block when it ends."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)

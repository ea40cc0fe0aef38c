"""True half precision: parameters, inputs and optimizer state in bf16 or fp16."""

from __future__ import annotations

import torch

from lightlike.precision.base import Precision, require_device_support


class HalfPrecision(Precision):
    """``bf16-true`` and ``16-true``: the module's floating parameters and float inputs are cast
    to the half dtype; no autocast and no scaler. Cheapest memory, least numerically safe."""

    def __init__(self, dtype: str = "bf16"):
        if dtype not in ("bf16", "16"):
            raise ValueError(f"HalfPrecision dtype must be 'bf16' or '16', got {dtype!r}")
        self.name = f"{dtype}-true"
        self.param_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        assert self.param_dtype is not None
        require_device_support(self.name, device, self.param_dtype)

"""Mixed precision: fp32 weights, autocast compute in bf16 or fp16 (with a gradient scaler)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from lightlike.precision.base import Precision, require_device_support


class MixedPrecision(Precision):
    """``bf16-mixed`` and ``16-mixed``.

    ``16-mixed`` scales the loss with ``torch.amp.GradScaler``. Policy for overflow: the
    optimizer step is skipped, the skip is counted in ``FitState.skipped_steps`` (logged as
    ``train/skipped_steps``), ``global_step`` still advances (so step-based logging, evaluation
    and data position stay predictable) and the learning-rate scheduler does **not** advance.
    """

    def __init__(self, dtype: str = "bf16", init_scale: float = 2.0**16, growth_interval: int = 2000):
        if dtype not in ("bf16", "16"):
            raise ValueError(f"MixedPrecision dtype must be 'bf16' or '16', got {dtype!r}")
        self.name = f"{dtype}-mixed"
        self.compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
        self.uses_scaler = dtype == "16"
        self._init_scale = init_scale
        self._growth_interval = growth_interval
        self.scaler: torch.amp.GradScaler | None = None
        self._stepped = False  # a scaler.step ran since the last update (update() needs one)

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        assert self.compute_dtype is not None
        require_device_support(self.name, device, self.compute_dtype)
        if self.uses_scaler:
            self.use_scaler(torch.amp.GradScaler)

    def use_scaler(self, scaler_class: type) -> None:
        """Scale with ``scaler_class`` (a strategy that shards gradients passes torch's
        ``ShardedGradScaler``), built with this plugin's ``init_scale`` and ``growth_interval``."""
        self.scaler = scaler_class(self.device.type, init_scale=self._init_scale, growth_interval=self._growth_interval)

    def reset(self) -> None:
        self._stepped = False
        if self.scaler is not None:
            self.use_scaler(type(self.scaler))

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(retain_graph=retain_graph)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        # torch's multi-optimizer recipe: scaler.step per optimizer, one scaler.update per step
        if self.scaler is None:
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        self._stepped = True
        # torch's own record of this step's inf/NaN gradients, read before update() clears it (one
        # host read, as step() makes anyway). A lowered scale says the same only until the scale
        # reaches 0.0 after ~166 overflows in a row: halving 0.0 lowers nothing, and every later
        # skip would have been counted as a step taken (and advanced the scheduler).
        found = self.scaler._found_inf_per_device(optimizer)
        return not bool(sum(float(v.item()) for v in found.values()))

    def update_scale(self) -> None:
        if self._stepped:
            self._stepped = False
            self.scaler.update()  # type: ignore[union-attr]

    def abandon_step(self, optimizer: torch.optim.Optimizer) -> None:
        # update() with the current scale clears the scaler's record of this step's unscaled
        # gradients (unscale_ refuses a second call before an update) and keeps scale and growth
        # as they were: the loop's skip is not an overflow the scaler should react to
        if self.scaler is not None:
            self._stepped = False  # (this update() consumes any earlier optimizer's step too)
            self.scaler.update(new_scale=self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

"""The ``Precision`` contract: how numbers are represented, scaled and stepped.

A precision plugin converts the module and inputs, provides the autocast context, runs
backward (scaling if it must), unscales gradients before clipping, steps the optimizer (and
says whether the step was taken), and carries its own checkpoint state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightlike.errors import ConfigError
from lightlike.utils.batches import map_tensors

#: the context of a forward pass or micro-step that needs none: one instance, reused (a
#: ``nullcontext`` holds no state, so it may be entered any number of times, also nested)
NO_CONTEXT = contextlib.nullcontext()


class Precision:
    """Full fp32 (``32-true``): the base every plugin refines."""

    name: str = "32-true"
    #: dtype the module's floating parameters are converted to, or None to leave them.
    param_dtype: torch.dtype | None = None
    #: dtype autocast computes in, or None for no autocast.
    compute_dtype: torch.dtype | None = None
    #: True when backward/step go through a gradient scaler (the loop may then see skips).
    uses_scaler: bool = False

    def setup(self, device: torch.device) -> None:
        """Check the device can run this precision; called once the device is known."""
        self.device = device

    def reset(self) -> None:
        """Start a fit from this plugin's initial state (a loss scale an earlier fit, or an
        out-of-memory retry's failed try, lowered is not carried into the next)."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Floating parameters and persistent buffers to ``param_dtype``. Non-persistent buffers
        (derived constants such as a rotary embedding's ``inv_freq``) keep their dtype, as HF
        keeps them when it loads a bf16 model: the model trained is the model exported."""
        dtype = self.param_dtype
        if dtype is None:
            return module
        saved = {id(t) for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for name, b in m.named_buffers(recurse=False):
                if b is not None and b.is_floating_point() and id(b) in saved and b.dtype != dtype:
                    m._buffers[name] = b.to(dtype)
        return module

    def convert_input(self, batch: Any) -> Any:
        if self.param_dtype is None:
            return batch
        return _cast_floats(batch, self.param_dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass runs in: none in fp32."""
        return NO_CONTEXT

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        loss.backward(retain_graph=retain_graph)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make gradients true (unscaled) values, before clipping or inspection."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Update the parameters with ``optimizer``. Returns False when a loss scaler skipped the
        update (overflow). The scale itself changes at ``update_scale``, once per training step
        whatever the number of optimizers (torch's recipe)."""
        optimizer.step()
        return True

    def update_scale(self) -> None:
        """The end of a training step: the loss scale reacts to its overflows, if any update ran."""

    def abandon_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The loop vetoes this update after ``unscale_gradients`` (``nonfinite_loss="skip"``):
        forget it, so the next step unscales afresh and the scale does not react to it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(f"a precision's state is a dict, not a {type(state).__name__}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


def require_device_support(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a clear error if ``device`` cannot compute in ``dtype``."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision={name!r} needs bfloat16, which {torch.cuda.get_device_name(device)} does "
            "not support; use precision='16-mixed' or '32-true'"
        )
    if device.type == "mps" and dtype == torch.bfloat16:
        raise ConfigError(f"precision={name!r}: MPS has no bfloat16 here; use '16-mixed' or '32-true'")

"""NEFTune (Jain et al., 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning").

``neftune_noise_alpha=alpha`` adds uniform noise to the output of the module's input embeddings
while training: for each item ``i`` of a batch of embeddings ``(batch, length, dim)``,
``U(-a_i, a_i)`` with ``a_i = alpha / sqrt(L_i * dim)``, drawn as
``torch.empty_like(embeddings).uniform_(-1, 1) * a_i`` from torch's generator of the embeddings'
device (the one lightlike's checkpoints save, so a resumed fit draws the same noise). ``L_i`` is
item ``i``'s real length, the sum of its ``attention_mask`` row when the batch given to the module
is a dict with an ``attention_mask`` of the embeddings' ``(batch, length)`` shape (for the second
call of the embeddings in one forward, a seq2seq decoder's input: ``decoder_attention_mask``),
else the padded ``length`` (the HF Trainer always uses the padded length; with no padding the
two agree).

No noise is added where the embedding module is in eval mode (evaluation and prediction). The
hooks are the only change: ``NEFTuneHooks.remove()`` leaves the modules exactly as they came.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightlike.errors import ConfigError, ModuleContractError


def input_embeddings(module: nn.Module) -> nn.Module:
    """The module whose output NEFTune makes noisy: ``module.input_embeddings()`` where the module
    defines it; else the input embeddings of the ``transformers`` model it holds as ``model``
    (``HFModel``, ``HFCausalLM``; PEFT models too) or is itself (``get_input_embeddings()``).
    A ``ConfigError`` saying how to name one otherwise."""
    own = getattr(module, "input_embeddings", None)
    if callable(own):
        found = own()
    else:
        holder = getattr(module, "model", None)
        holder = holder if callable(getattr(holder, "get_input_embeddings", None)) else module
        getter = getattr(holder, "get_input_embeddings", None)
        found = getter() if callable(getter) else None
    if not isinstance(found, nn.Module):
        raise ConfigError(
            f"neftune_noise_alpha is set, but {type(module).__name__} names no input embeddings (got "
            f"{type(found).__name__}): define a method input_embeddings(self) returning the nn.Embedding whose output "
            "gets the noise (an HFModel/HFCausalLM finds it by get_input_embeddings()), or drop neftune_noise_alpha",
            settings=("neftune_noise_alpha",))
    return found


class NEFTuneHooks:
    """The hooks of one fit: a forward pre-hook on the ``TaskModule`` that reads each batch's
    masks, a forward hook that marks the module's forward ended (a training forward that never
    called the embeddings is an error, not a fit without noise), and a forward hook on its input
    embeddings (and the ``nn.Embedding`` modules tied to their weight: T5's encoder's and
    decoder's) that adds the noise. Within one forward of the module, the first call of the
    embeddings takes ``attention_mask``'s lengths and the second (a seq2seq decoder's input)
    ``decoder_attention_mask``'s, each where it has the embeddings' shape (else the padded
    length). ``remove()`` takes the hooks off (idempotent)."""

    def __init__(self, module: nn.Module, alpha: float):
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ConfigError(f"neftune_noise_alpha must be a finite number > 0 (the paper uses 5, 10, 15), got "
                              f"{alpha!r}", settings=("neftune_noise_alpha",))
        self.alpha = float(alpha)
        self.module_name = type(module).__name__
        self.embeddings = input_embeddings(module)
        weight = getattr(self.embeddings, "weight", None)  # the embeddings tied to it (T5's encoder's, decoder's)
        tied = [m for m in module.modules() if isinstance(m, nn.Embedding) and weight is not None and m.weight is weight]
        self.masks: list[Any] = []
        self.calls, self.inside = 0, False
        self.handles = [module.register_forward_pre_hook(self._read_masks),
                        module.register_forward_hook(self._forward_ended),
                        *(m.register_forward_hook(self._add_noise) for m in dict.fromkeys([self.embeddings, *tied]))]

    def _read_masks(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        batch = args[0] if args else None
        keys = ("attention_mask", "decoder_attention_mask")
        self.masks = [batch.get(k) for k in keys] if isinstance(batch, Mapping) else []
        self.calls, self.inside = 0, True

    def _forward_ended(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.masks, self.inside = [], False
        if module.training and self.calls == 0:
            raise ModuleContractError(
                f"neftune_noise_alpha: {self.module_name}'s forward never called its input embeddings "
                f"({type(self.embeddings).__name__}), so no noise was added: define input_embeddings() to return the "
                "embedding module the forward calls, or drop neftune_noise_alpha")

    def _add_noise(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None
        if not self.inside:  # a recomputation in backward would draw noise for lengths it cannot know
            raise ModuleContractError(
                "neftune_noise_alpha: the input embeddings ran outside the module's forward (activation "
                "checkpointing around them recomputes them in backward), where the items' lengths are unknown: "
                "checkpoint only the blocks after the embeddings, or drop neftune_noise_alpha")
        mask = self.masks[self.calls] if self.calls < len(self.masks) else None
        self.calls += 1
        return output + neftune_noise(output, self.alpha, mask)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.masks, self.inside = [], [], False


def neftune_noise(embeddings: torch.Tensor, alpha: float, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The noise added to ``embeddings`` ``(batch, length, dim)``: ``U(-a_i, a_i)`` per item, with
    ``a_i = alpha / sqrt(L_i * dim)``, ``L_i`` the row sum of ``attention_mask`` where it has the
    embeddings' ``(batch, length)`` shape (at least 1), else ``length``. Draws from torch's generator."""
    if embeddings.ndim != 3:
        raise ConfigError(f"neftune_noise_alpha: the input embeddings gave a tensor of shape {tuple(embeddings.shape)}, "
                          "not (batch, length, dim)", settings=("neftune_noise_alpha",))
    batch, length, dim = embeddings.shape
    if attention_mask is not None and tuple(attention_mask.shape) == (batch, length):
        lengths = attention_mask.sum(-1).clamp(min=1).to(torch.float32)
    else:
        lengths = torch.full((batch,), float(length), device=embeddings.device)
    scale = alpha / torch.sqrt(lengths.to(embeddings.device) * dim)
    noise = torch.empty_like(embeddings).uniform_(-1, 1)
    return noise * scale.to(embeddings.dtype).view(batch, 1, 1)


def attach_neftune(module: Any, alpha: float | None, previous: NEFTuneHooks | None = None) -> NEFTuneHooks | None:
    """The fit's NEFTune hooks on ``module`` (None when ``alpha`` is None), after removing
    ``previous`` (an earlier try's, say)."""
    if previous is not None:
        previous.remove()
    return None if alpha is None else NEFTuneHooks(module, alpha)


__all__ = ["NEFTuneHooks", "attach_neftune", "input_embeddings", "neftune_noise"]

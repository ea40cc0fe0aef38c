"""Checkpoints of a module that trains a part of a frozen base (a PEFT adapter).

A module says what its checkpoints hold through ``TaskModule.checkpoint_keys()``: None (the
default) for its whole ``state_dict()``, or the keys of the part it trains (``HFCausalLM`` and
``HFModel`` around a ``peft.PeftModel`` name the trainable parameters and the buffers). The
strategies' layouts save and load only those keys (``saved_state``, ``load_saved_state``); the
rest, the frozen base, is recorded by its fingerprint, an XXH3-128 of its names, dtypes, shapes
and bytes, computed once at set-up before the strategy shards anything (``BaseFingerprint``: the
``base_fingerprint.json`` entry of every checkpoint). A resume onto another base is refused
before anything loads, naming both fingerprints.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightlike.errors import CheckpointError, ConfigError

#: the algorithm of the fingerprint (``xxhash.xxh3_128``), recorded beside it
ALGORITHM = "xxh3_128"


def checkpoint_keys(module: nn.Module) -> frozenset[str] | None:
    """The keys of ``module.state_dict()`` its checkpoints hold: what its ``checkpoint_keys()``
    names (a module that is not a ``TaskModule`` has none), or None for all of them."""
    hook = getattr(module, "checkpoint_keys", None)
    keys = hook() if callable(hook) else None
    return None if keys is None else frozenset(keys)


def trained_keys(module: nn.Module) -> frozenset[str]:
    """The keys of ``module.state_dict()`` that are not frozen parameters: the parameters with
    ``requires_grad`` and every buffer (persistent ones: those a state dict holds)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return frozenset(k for k in module.state_dict(keep_vars=True)
                     if k not in params or params[k].requires_grad)


def saved_state(module: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (the module's whole state dict, as a layout gathers it) restricted to what its
    checkpoints hold."""
    keys = checkpoint_keys(module)
    return dict(state) if keys is None else {k: v for k, v in state.items() if k in keys}


def expected_state(module: nn.Module, own: Mapping[str, Any], stored: Collection[str]) -> dict[str, Any]:
    """The part of the module's state dict ``own`` that a checkpoint holding ``stored`` keys must
    fit: the checkpointed keys, and any frozen key it holds too (a checkpoint that holds the whole
    module, written before the module named its part, loads whole)."""
    keys = checkpoint_keys(module)
    if keys is None:
        return dict(own)
    return {k: v for k, v in own.items() if k in keys or k in stored}


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """XXH3-128 (hex) of the tensors of ``state`` in the order of their names: each name, dtype,
    shape and bytes. The same weights under the same names give the same fingerprint, on any
    device; one changed bit gives another."""
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return h.hexdigest()


def frozen_state(module: nn.Module, keys: Collection[str]) -> dict[str, torch.Tensor]:
    """The entries of ``module.state_dict()`` not in ``keys``: the frozen base."""
    return {k: v for k, v in module.state_dict().items() if k not in keys}


class BaseFingerprint:
    """The ``base_fingerprint`` entry of a checkpoint (``base_fingerprint.json``): the
    fingerprint of the frozen weights the module was trained on, taken at set-up (``of``), and
    the number of trained keys. No file for a module whose checkpoints hold everything. A resume
    checks it (``check_resume``) before anything loads."""

    def __init__(self, value: str | None = None, trained: int = 0, frozen: int = 0):
        self.value, self.trained, self.frozen = value, trained, frozen

    @classmethod
    def of(cls, module: nn.Module) -> BaseFingerprint:
        """The fingerprint of ``module``'s frozen base, before any strategy wraps or shards it;
        an empty one (nothing written) when it checkpoints everything. A module that names its
        trained part but trains no parameter is refused here, at set-up."""
        keys = checkpoint_keys(module)
        if keys is None:
            return cls()
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(
                f"{type(module).__name__} trains nothing: every parameter has requires_grad=False (a PeftModel "
                "made for inference: get_peft_model with a config of inference_mode=False, or "
                "PeftModel.from_pretrained(base, folder, is_trainable=True), gives a trainable adapter)")
        frozen = frozen_state(module, keys)
        return cls(fingerprint(frozen), len(keys), len(frozen))

    def state_dict(self) -> dict[str, Any] | None:
        if self.value is None:
            return None
        return {"algorithm": ALGORITHM, "fingerprint": self.value, "trained_keys": self.trained,
                "frozen_keys": self.frozen}

    def load_state_dict(self, state: Any) -> None:
        pass  # a record: check_resume compares it

    def check_resume(self, loading: Any) -> None:
        check_fingerprint(loading.path, loading.saved.get("base_fingerprint"), self.value)


def check_fingerprint(path: Path, saved: Mapping[str, Any] | None, current: str | None) -> None:
    """Refuse a checkpoint trained on another frozen base than this module's (``current``), or
    one that holds only a trained part when this module checkpoints everything."""
    theirs = (saved or {}).get("fingerprint")
    if theirs is None or theirs == current:
        return
    if current is None:
        raise CheckpointError(
            f"{path} holds only the trained part of a module (its base weights are not in it: fingerprint "
            f"{theirs}), and this module checkpoints all of its weights: wrap the same adapter model "
            "(a peft.PeftModel) as the run that wrote it did")
    raise CheckpointError(
        f"{path} was trained on another base model than this module's: the checkpoint's base fingerprint is "
        f"{theirs}, this module's {current} (XXH3-128 of the frozen weights). Load the base weights that run "
        "started from (same model, revision and dtype) before wrapping it, or start a new fit without resume")


def check_base(module: nn.Module, path: Path) -> None:
    """``module.load_weights`` of a checkpoint at ``path``: refuse it when it was trained on
    another base than ``module``'s (its ``base_fingerprint.json`` against the module's frozen part)."""
    saved = base_fingerprint_file(path)
    if saved is None:
        return
    keys = checkpoint_keys(module)
    check_fingerprint(path, saved, None if keys is None else fingerprint(frozen_state(module, keys)))


def base_fingerprint_file(path: Path) -> Mapping[str, Any] | None:
    """The ``base_fingerprint.json`` of the checkpoint at ``path``, or None without one."""
    import json

    from lightlike.checkpoint.files import FILES

    file = Path(path) / FILES["base_fingerprint"]
    return json.loads(file.read_text()) if file.is_file() else None


__all__ = ["BaseFingerprint", "check_base", "check_fingerprint", "checkpoint_keys", "expected_state", "fingerprint",
           "frozen_state", "saved_state", "trained_keys"]

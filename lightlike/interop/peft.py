"""PEFT adapters (``peft.PeftModel``) inside ``HFCausalLM``/``HFModel``: what is recorded of them,
and how a checkpoint that holds only the adapter becomes an adapter folder or a merged model.

* ``record_peft``: the wrapper records the base model's class (``hparams["hf_class"]``) and the
  adapter's config (``hparams["peft_config"]``, the dict ``adapter_config.json`` holds), so a
  checkpoint alone says how to rebuild the adapter;
* ``is_peft_model``: a model PEFT made (duck-typed: peft is imported only when exporting);
* ``adapter_model``: a checkpoint's adapter weights put back into a ``PeftModel`` built on the
  base (``base=`` a model or a folder; without it, a base built from the recorded config on the
  meta device, which is enough to write the adapter folder but not a merged model).

peft is imported only by ``adapter_model`` and ``merged_copy``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightlike.errors import CheckpointError, ConfigError


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (or one of its task classes)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model") and hasattr(model, "active_adapter")


def record_peft(hparams: dict[str, Any], model: Any) -> None:
    """Record in ``hparams`` the base model's class and the active adapter's config, as
    ``adapter_config.json`` would hold it (sets as sorted lists, enums as their values)."""
    hparams["hf_class"] = type(model.get_base_model()).__name__
    config = model.peft_config[model.active_adapter]
    hparams["peft_config"] = json.loads(json.dumps(config.to_dict(), default=_plain))


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def merged_copy(model: Any) -> Any:
    """A copy of the ``PeftModel`` ``model`` with its adapter merged into the base weights
    (peft's ``merge_and_unload``): a plain ``transformers`` model; ``model`` is left as it is."""
    return copy.deepcopy(model).merge_and_unload()


def adapter_model(state: Mapping[str, torch.Tensor], hparams: Mapping[str, Any], hf_config: Any, cls: type | None,
                  *, base: Any, merge: bool, src: Path, prefix: str) -> Any:
    """The model to ``save_pretrained`` for a checkpoint that holds a PEFT adapter (``state``:
    its weights, keys without ``prefix``): the ``PeftModel`` (an adapter folder) or, with
    ``merge``, the merged model. ``base`` (a ``transformers`` model, copied and left as it is, or
    a folder ``from_pretrained`` reads) is checked against the checkpoint's base fingerprint;
    ``merge`` needs it. Without it the base is built from ``hf_config`` on the meta device."""
    import peft

    from lightlike.checkpoint.frozen import base_fingerprint_file, check_fingerprint, fingerprint

    if merge and base is None:
        raise CheckpointError(
            f"{src} holds a PEFT adapter only, not the base model it was trained on: a merged export needs that "
            "base: pass base=<the transformers model or its folder> (on the command line: --base FOLDER), or "
            "export the adapter alone (merge=False) and load it with PeftModel.from_pretrained(base, folder)")
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    model = _base(base, hf_config, cls, dtype)
    config = peft.PeftConfig.from_peft_type(**dict(hparams["peft_config"]))
    peft_model = peft.get_peft_model(model, config)
    own = peft_model.state_dict()
    frozen = {prefix + k: v for k, v in own.items() if k not in state}  # none: a checkpoint of the whole model
    if base is not None and frozen:  # the base it was trained on? (the frozen part of the wrapper's state, by name)
        saved = base_fingerprint_file(src)
        check_fingerprint(src, saved, fingerprint(frozen) if saved else None)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    missing = [k for k in trainable if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"the adapter weights of {src} do not fit the PeftModel rebuilt from its hparams.json "
                              f"(peft_config): missing {missing[:5]}, unexpected {unexpected[:5]}")
    peft_model.load_state_dict(dict(state), strict=False, assign=base is None)
    return peft_model.merge_and_unload() if merge else peft_model


def _base(base: Any, hf_config: Any, cls: type | None, dtype: torch.dtype) -> Any:
    import transformers

    if base is None:  # the adapter folder needs only the adapter: no base weights are made
        with torch.device("meta"):
            model = cls(hf_config) if cls is not None else transformers.AutoModelForCausalLM.from_config(hf_config)
        return model.to(dtype)
    if isinstance(base, (str, os.PathLike)):
        loader: Any = cls if cls is not None else transformers.AutoModelForCausalLM
        return loader.from_pretrained(str(base), dtype=dtype)
    if isinstance(base, torch.nn.Module):
        if is_peft_model(base):
            raise ConfigError("export_hf(base=...) takes the base model, not a PeftModel: pass "
                              "peft_model.get_base_model() as it was before the adapter was added, or its folder")
        return copy.deepcopy(base)  # get_peft_model changes the model it wraps
    raise ConfigError(f"export_hf(base=...) takes a transformers model or a folder from_pretrained reads, "
                      f"got {type(base).__name__}")


__all__ = ["adapter_model", "is_peft_model", "merged_copy", "record_peft"]

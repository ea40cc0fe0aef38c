"""Train ``transformers`` models with lightlike, and export them back.

``HFCausalLM(model)`` is a thin ``TaskModule`` around any ``AutoModelForCausalLM`` model:

* ``forward(batch)`` calls ``model(input_ids=..., attention_mask=..., use_cache=False)`` and
  returns the logits (the batch is a dict with ``input_ids`` and optionally ``attention_mask``,
  ``labels``, ``position_ids``; or a tensor of token ids);
* ``loss`` is the token-mean cross entropy of the next token, HF's convention: ``labels`` (or,
  without them, ``input_ids`` with padding masked by ``attention_mask``) are shifted by one
  inside, and positions labelled ``-100`` do not count;
* ``num_items`` is the number of tokens that count, so gradient accumulation and evaluation
  are exact over *tokens*: the step's gradient is that of the mean loss over every counted token
  of the step, however the padding falls across micro-batches and processes;
* ``metrics``: next-token ``accuracy`` over the same tokens (``perplexity = exp(val/loss)``).

``HFModel(model)`` wraps any other model that computes its own loss from the batch (sequence
and token classification, question answering, seq2seq, masked LM): ``forward`` is
``model(**batch)``, ``loss`` the model's own, ``num_items`` what that loss averages over.

``export_hf(checkpoint_dir or module, out_dir)`` writes a folder that the matching
``AutoModelFor....from_pretrained(out_dir)`` loads (``config.json`` naming the architecture,
``model.safetensors``); tied embeddings are written once and tied again on load. Around a
``peft.PeftModel`` the wrappers checkpoint the adapter alone (``checkpoint_keys``) and
``export_hf`` writes the adapter folder, or with ``merge=True`` the merged model
(``lightlike/interop/peft.py``).

transformers is imported only by ``export_hf`` and ``HFModel`` (and by whoever built the model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from lightlike.checkpoint.export import checkpoint_of, export_weights, fsync_replace, new_folder
from lightlike.checkpoint.frozen import trained_keys
from lightlike.checkpoint.weights import load_safetensors
from lightlike.data.collators import mask_padded_context
from lightlike.data.hf_datasets import HFCollator
from lightlike.data.keys import module_batch_keys
from lightlike.errors import CheckpointError, ConfigError, DataError, ModuleContractError
from lightlike.interop.peft import adapter_model, is_peft_model, merged_copy, record_peft
from lightlike.module import TaskModule, batch_length

IGNORE_INDEX = -100

#: batch keys passed on to the model besides ``input_ids`` when present
MODEL_INPUTS = ("attention_mask", "position_ids", "token_type_ids")


class HFWrapper(TaskModule):
    """What every wrapper of a ``transformers`` model shares: the model is ``self.model``, its
    config is recorded in ``hparams["hf_config"]`` and its class in ``hparams["hf_class"]``
    (saved in every checkpoint as ``hparams.json``: what ``export_hf`` rebuilds it from), and
    ``gradient_checkpointing=True`` switches on the model's own activation checkpointing.

    ``data_collator`` batches the items of a dataset passed to ``fit``/``validate``/``predict``
    (``lightlike.data.HFCollator``): sequences of different lengths are padded with
    ``pad_token_id``, else the ``tokenizer``'s pad token (and its ``padding_side``), else the
    model config's ``pad_token_id``; set ``module.data_collator`` to another collator (a
    transformers one) to replace it."""

    def __init__(self, model: Any, *, ignore_index: int = IGNORE_INDEX, tokenizer: Any = None,
                 pad_token_id: int | None = None):
        super().__init__()
        self.model = model
        self.ignore_index = ignore_index
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.data_collator = HFCollator(pad_token_id, getattr(tokenizer, "padding_side", None) or "right")
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            self.hparams["hf_config"] = json.loads(config.to_json_string(use_diff=False))
            self.hparams["hf_class"] = type(model).__name__
        if is_peft_model(model):  # the base's class and the adapter's config (lightlike/interop/peft.py)
            record_peft(self.hparams, model)

    def checkpoint_keys(self) -> frozenset[str] | None:
        """Around a ``peft.PeftModel``: the adapter (trainable parameters) and the buffers, which
        checkpoints hold with a fingerprint of the frozen base; otherwise None (everything)."""
        return trained_keys(self) if is_peft_model(self.model) else None

    # -- gradient checkpointing: the model's own, switched on by the Fitter at set-up ---------------
    def gradient_checkpointing_enable(self) -> None:
        if self.gradient_checkpointing:
            return
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        super().gradient_checkpointing_enable()

    def gradient_checkpointing_disable(self) -> None:
        if not self.gradient_checkpointing:
            return
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5
            self.model.activation_checkpointing_disable()
        else:
            self.model.gradient_checkpointing_disable()
        super().gradient_checkpointing_disable()


class HFCausalLM(HFWrapper):
    """A ``transformers`` causal LM (``AutoModelForCausalLM`` and the like) as a ``TaskModule``.

    The model is ``self.model``; its config is recorded in ``hparams["hf_config"]`` (saved in
    every checkpoint as ``hparams.json``), which is what ``export_hf`` rebuilds it from."""

    def __init__(self, model: Any, *, ignore_index: int = IGNORE_INDEX, model_inputs: tuple[str, ...] = MODEL_INPUTS,
                 tokenizer: Any = None, pad_token_id: int | None = None):
        super().__init__(model, ignore_index=ignore_index, tokenizer=tokenizer, pad_token_id=pad_token_id)
        self.model_inputs = tuple(model_inputs)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """What this module reads of a batch (``remove_unused_keys`` keeps these)."""
        return ("input_ids", "labels", *self.model_inputs)

    # -- the TaskModule contract ---------------------------------------------------------------
    def forward(self, batch: Any) -> torch.Tensor:
        ids = self._input_ids(batch)
        kwargs = {k: batch[k] for k in self.model_inputs if isinstance(batch, Mapping) and batch.get(k) is not None}
        out = self.model(input_ids=ids, use_cache=False, **kwargs)
        return out.logits if hasattr(out, "logits") else out[0]

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        logits, labels = self._shifted(outputs, batch)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                ignore_index=self.ignore_index, reduction="sum")
        # a micro-batch with no counted token has loss 0 and weight 0 (not 0/0 = NaN)
        return total / (labels != self.ignore_index).sum().clamp(min=1)

    def num_items(self, batch: Any) -> torch.Tensor:
        return (self.shifted_labels(batch) != self.ignore_index).sum()

    def metrics(self, outputs: torch.Tensor, batch: Any) -> dict[str, torch.Tensor]:
        logits, labels = self._shifted(outputs, batch)
        counted = labels != self.ignore_index
        hits = ((logits.argmax(-1) == labels) & counted).sum()
        return {"accuracy": hits.double() / counted.sum().clamp(min=1).double()}

    # -- helpers -------------------------------------------------------------------------------
    def shifted_labels(self, batch: Any) -> torch.Tensor:
        """The next-token targets, ``(batch, seq_len - 1)``: ``labels[:, 1:]``, or without
        labels ``input_ids[:, 1:]`` with padding (``attention_mask == 0``) set to ``-100``. A
        target predicted from a padding position is not one either: with left padding the first
        real token of a padded row would otherwise be counted, so the loss and the item count
        would depend on what else is in the batch (``mask_padded_context``)."""
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if isinstance(batch, Mapping) and batch.get("labels") is not None:
            labels = batch["labels"]
        else:
            labels = self._input_ids(batch)
            if mask is not None:
                labels = labels.masked_fill(mask == 0, self.ignore_index)
        if labels.ndim != 2:
            raise DataError(f"HFCausalLM expects labels/input_ids of shape (batch, seq_len), got {tuple(labels.shape)}")
        return mask_padded_context(labels[:, 1:], mask, self.ignore_index)

    def _shifted(self, outputs: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = outputs[:, :-1]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the softmax in float32, as HF does
        return logits, self.shifted_labels(batch)

    def _input_ids(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, torch.Tensor):
            return batch
        if isinstance(batch, Mapping):
            return batch["input_ids"]  # a KeyError is reported by the Fitter with the batch's keys
        raise ModuleContractError(f"HFCausalLM takes a dict batch with 'input_ids' or a tensor, got {type(batch).__name__}")


class HFModel(HFWrapper):
    """Any ``transformers`` model that computes its own loss from the batch, as a ``TaskModule``:
    sequence classification (``labels`` of shape ``(batch,)``), token classification and
    seq2seq (``labels`` of shape ``(batch, seq_len)``, ``-100`` where nothing counts), question
    answering (``start_positions`` and ``end_positions``), masked LM.

    * ``forward(batch)`` is ``model(**batch)`` (the model's output, a ``ModelOutput``);
    * ``loss`` is that output's own ``loss``;
    * ``num_items`` is what that loss averages over, so accumulation and evaluation are exact:
      integer ``labels`` count where they are not ``-100`` (tokens, or items); float ``labels``
      (regression, multi-label) and batches without ``labels`` (question answering) count items;
    * ``metrics``: ``accuracy`` (argmax of the last dimension against ``labels``, over the
      counted labels) where the logits line up with integer labels.

    The labels are counted as they are, not shifted: a causal LM, whose loss shifts them inside,
    is refused here and belongs in ``HFCausalLM``."""

    def __init__(self, model: Any, *, tokenizer: Any = None, pad_token_id: int | None = None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        from transformers.utils import find_labels

        if type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
            raise ModuleContractError(
                f"HFModel got a causal LM ({type(model).__name__}), whose loss shifts the labels by one inside: "
                "counting them as they are would weigh its micro-batches wrongly. Wrap it in "
                "lightlike.interop.HFCausalLM instead")
        # what transformers' losses ignore
        super().__init__(model, ignore_index=IGNORE_INDEX, tokenizer=tokenizer, pad_token_id=pad_token_id)
        #: the model's forward takes use_cache: passed False (no key/value cache built or collected)
        self.cache_off = "use_cache" in module_batch_keys(model)
        #: the batch keys the HF Trainer collects as labels (``find_labels``): ``labels``, or
        #: ``start_positions`` and ``end_positions`` for question answering
        self.label_names = tuple(find_labels(type(model)))

    @property
    def batch_keys(self) -> frozenset[str]:
        """What the model's ``forward`` names (``remove_unused_keys`` keeps these)."""
        return module_batch_keys(self.model)

    def forward(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping):
            raise ModuleContractError(f"HFModel takes a dict batch (the model's keyword arguments: input_ids, "
                                      f"labels, ...), got {type(batch).__name__}")
        for key, value in batch.items():
            if type(value) is list and value and not isinstance(value[0], torch.Tensor):
                raise DataError(
                    f"batch column {key!r} holds {type(value[0]).__name__} values, which {type(self.model).__name__} "
                    f"cannot take: drop the column (remove_unused_columns=True drops the columns the model's forward "
                    f"does not name; dataset.remove_columns([{key!r}])) or turn it into numbers (tokenize it)")
        if self.cache_off and "use_cache" not in batch:
            return self.model(**batch, use_cache=False)
        return self.model(**batch)

    def labels(self, batch: Any) -> Any:
        """The batch's labels as the HF Trainer collects them (``label_names``), a tuple when
        there are several; None when the batch lacks one."""
        values = tuple(batch.get(k) for k in self.label_names) if isinstance(batch, Mapping) else ()
        if not values or any(v is None for v in values):
            return None
        return values[0] if len(values) == 1 else values

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            raise DataError(
                f"{type(self.model).__name__} computed no loss from a batch with keys {sorted(batch)}: put its "
                "targets in the batch (labels; start_positions and end_positions for question answering)")
        return loss

    def num_items(self, batch: Any) -> int | torch.Tensor:
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if labels is None or labels.is_floating_point():
            return batch_length(batch)  # a mean over items (times a constant for multi-label)
        return (labels != self.ignore_index).sum()  # the cross entropy's mean over counted labels

    def metrics(self, outputs: Any, batch: Any) -> dict[str, torch.Tensor]:
        logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if (logits is None or labels is None or labels.is_floating_point()
                or tuple(logits.shape[:-1]) != tuple(labels.shape)):
            return {}
        counted = labels != self.ignore_index
        hits = ((logits.argmax(-1) == labels) & counted).sum()
        return {"accuracy": hits.double() / counted.sum().clamp(min=1).double()}


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------
def export_hf(source: Any, out_dir: str | Path, *, config: Any = None, prefix: str = "model.",
              hashes: bool = True, base: Any = None, merge: bool = False) -> Path:
    """Write ``out_dir`` as a Hugging Face model folder (``config.json`` naming the architecture,
    ``model.safetensors``, ``generation_config.json`` for generative models) that the matching
    ``AutoModelFor....from_pretrained(out_dir)`` loads (``AutoModelForCausalLM``,
    ``AutoModelForSequenceClassification``, ...).

    ``source`` is an ``HFModel`` or ``HFCausalLM`` (or a ``transformers`` model), or a lightlike
    checkpoint folder (verified; sharded FSDP/DeepSpeed checkpoints are consolidated first). A
    checkpoint's model is rebuilt from ``hparams["hf_config"]`` (recorded by the wrapper) or from
    ``config`` (a ``PretrainedConfig``, a dict, or a folder/file with a ``config.json``), as the
    class the wrapper recorded (``hparams["hf_class"]``), else the one the config's
    ``architectures`` names, else a causal LM; its weights are the checkpoint's keys under ``prefix``. Files land atomically, one by one;
    other files in ``out_dir`` are left alone. Returns ``out_dir``.

    A PEFT adapter (a ``PeftModel`` in the wrapper, or a checkpoint of one, which holds the
    adapter alone) is written as the adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, out_dir)`` loads; with
    ``merge=True`` as the merged model (peft's ``merge_and_unload``; the module is left as it is).
    A checkpoint's merged export needs ``base``: the base model (copied, left as it is) or its
    folder, checked against the checkpoint's base fingerprint (``base`` given for an adapter
    export is checked too); the adapter alone needs no base weights.

    Under ``torch.distributed`` only rank 0 writes (as ``save_pretrained`` does); the other ranks
    return at once, creating nothing and waiting for nobody, so it may be called on every rank or
    on rank 0 alone (put a barrier after it before another rank reads the folder)."""
    out = Path(out_dir)
    checkpoint = isinstance(source, (str, os.PathLike))
    if not checkpoint:
        model = source.model if isinstance(source, HFWrapper) else source
        if merge and not is_peft_model(model):
            raise ConfigError(f"export_hf(merge=True) merges a PEFT adapter into its base; {type(model).__name__} "
                              "is not a PeftModel: drop merge=True")
        if not hasattr(model, "save_pretrained"):
            raise ModuleContractError(f"export_hf takes an HFModel, an HFCausalLM, a transformers model or a checkpoint "
                                      f"folder, got {type(source).__name__}")
        if any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters()):
            # save_pretrained would write each rank's shard (ZeRO-3: empty tensors) or wait in a collective
            raise ModuleContractError(
                "export_hf got a module whose parameters are sharded across processes (trained with FSDP or "
                "DeepSpeed ZeRO-3): export a checkpoint instead, whose shards are consolidated: "
                "export_hf('OUTPUT_DIR/checkpoint-N', out_dir), on one process")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return out  # transformers writes on rank 0 only: an empty folder here would look like a failed export
    with new_folder(out):  # (a failed export leaves no folder behind that it created)
        if checkpoint:  # a run's output_dir: its newest valid checkpoint
            model = _model_from_checkpoint(checkpoint_of(source, hashes, "export_hf"), config, prefix, hashes, out,
                                           base, merge)
        elif merge:
            model = merged_copy(model)
        tmp = Path(tempfile.mkdtemp(prefix=".export-hf-", dir=out))
        try:
            model.save_pretrained(str(tmp))
            for f in sorted(tmp.iterdir()):
                fsync_replace(f, out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _model_from_checkpoint(src: Path, config: Any, prefix: str, hashes: bool, scratch: Path, base: Any = None,
                           merge: bool = False) -> Any:
    import transformers

    with tempfile.TemporaryDirectory(prefix=".export-weights-", dir=scratch) as tmp:
        weights = export_weights(src, tmp, hashes=hashes)  # verifies; consolidates shards
        state = load_safetensors(weights)
        hparams_file = Path(tmp) / "hparams.json"
        hparams = json.loads(hparams_file.read_text()) if hparams_file.is_file() else {}
    hf_config = _resolve_config(config, hparams, src)
    if prefix:
        if not any(k.startswith(prefix) for k in state):
            raise CheckpointError(f"{src} has no weights under {prefix!r} (first keys: {sorted(state)[:3]}); "
                                  "pass the prefix the module stored the model under, e.g. prefix=''")
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    cls = _model_class(hf_config, hparams)
    if hparams.get("peft_config"):  # the adapter alone (lightlike/interop/peft.py)
        return adapter_model(state, hparams, hf_config, cls, base=base, merge=merge, src=src, prefix=prefix)
    if merge or base is not None:
        raise ConfigError(f"export_hf: {src} holds a whole model, not a PEFT adapter: drop merge= and base=")
    model = cls(hf_config) if cls is not None else transformers.AutoModelForCausalLM.from_config(hf_config)
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    if dtype is not None:
        model.to(dtype)
    own = model.state_dict()
    tied = set(_tied_keys(model))
    missing = [k for k in own if k not in state and k not in tied]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in state if k in own and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"the weights of {src} do not fit {type(model).__name__}: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}, shape mismatches {mismatched[:10]}")
    model.load_state_dict(state, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    now = model.state_dict()
    differ = [k for k, v in state.items() if not torch.equal(now[k], v)]
    if differ:  # two checkpoint tensors loaded into one tied parameter, with different values
        raise CheckpointError(f"{src}: {differ[:5]} are tied in the model ({hf_config.model_type}) but differ in the "
                              "checkpoint; pass a config with tie_word_embeddings=False")
    return model


def _resolve_config(config: Any, hparams: Mapping[str, Any], src: Path) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return AutoConfig.from_pretrained(str(config))
    data = dict(config) if isinstance(config, Mapping) else hparams.get("hf_config")
    if not data:
        raise CheckpointError(f"{src} records no Hugging Face config (hparams.json has no 'hf_config': the "
                              "module was not an HFModel or HFCausalLM); pass config=<PretrainedConfig, dict or folder>")
    data = dict(data)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise CheckpointError(f"the Hugging Face config for {src} has no model_type")
    return AutoConfig.for_model(model_type, **data)


def _model_class(hf_config: Any, hparams: Mapping[str, Any]) -> type | None:
    """The ``transformers`` class to rebuild: the one the wrapper recorded (what was trained),
    else the first the config's ``architectures`` names; None when neither names one."""
    import transformers

    names = [hparams.get("hf_class"), *(getattr(hf_config, "architectures", None) or [])]
    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) and name else None
        if isinstance(cls, type):
            return cls
    return None


def _tied_keys(model: Any) -> list[str]:
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    if isinstance(keys, Mapping):
        return list(keys)
    return list(keys)


__all__ = ["HFCausalLM", "HFModel", "HFWrapper", "export_hf"]

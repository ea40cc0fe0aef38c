"""``compute_metrics`` in the HF Trainer's form: ``compute_metrics(eval_pred)``, one argument with
``eval_pred.predictions`` and ``eval_pred.label_ids`` as numpy arrays.

A module's ``compute_metrics(predictions, labels)`` gets the whole set's tensors, as lightlike
joins them. A ``compute_metrics`` that takes one argument is the HF Trainer's: it gets an
``EvalPrediction`` of numpy arrays instead, so a function written for the Trainer runs unchanged
(as a method, a staticmethod, or set on the module: ``module.compute_metrics = compute_metrics``).
The arrays are made once, at the end of an evaluation, from the joined tensors (bfloat16 as
float32, which numpy lacks, as the Trainer does); padding stays ``PAD_VALUE`` (-100), as there.
Each batch's predictions are first put in the form the Trainer's ``prediction_step`` gives
(``TrainerForm``: a model output's values without its loss and cache, the bare logits when
that is all), and ``preprocess_logits_for_metrics`` is applied to them, batch by batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightlike.errors import DataError, ModuleContractError


class EvalPrediction:
    """What an HF-style ``compute_metrics(eval_pred)`` gets, as transformers' own class: the
    attributes ``predictions``, ``label_ids``, ``inputs`` and ``losses`` (numpy arrays, or tuples
    of them), and the elements ``(predictions, label_ids)``, followed by ``inputs`` and ``losses``
    where they are set, for unpacking and indexing (``predictions, labels = eval_pred``)."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses
        self.elements = (predictions, label_ids) + ((inputs,) if inputs is not None else ()) + (
            (losses,) if losses is not None else ())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.elements)

    def __getitem__(self, index: int) -> Any:
        if index < 0 or index >= len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[index]

    def __len__(self) -> int:
        return len(self.elements)


#: model outputs never collected as predictions (besides the model config's keys_to_ignore_at_inference)
IGNORED_OUTPUTS = ("loss", "past_key_values", "cache", "mems")


class TrainerForm:
    """How one evaluation prepares what ``compute_metrics`` gets, batch by batch, as the HF
    Trainer's ``prediction_step`` and ``evaluation_loop`` do. For a module whose
    ``compute_metrics`` takes ``eval_pred``: a model output (a mapping) becomes the tuple of its
    values minus ``loss``, the key/value cache and the config's ``keys_to_ignore_at_inference``,
    a 1-tuple its element (the bare logits); ``include`` (``FitConfig.include_for_metrics``)
    adds the batch's ``input_ids`` (the model's ``main_input_name``) as ``inputs`` and its loss,
    once per item, as ``losses``. For any module, ``preprocess_logits_for_metrics(predictions,
    labels)`` (a method or attribute) is applied to each batch's predictions before they are kept."""

    def __init__(self, module: Any, include: Any = ()):
        fn = getattr(module, "compute_metrics", None)
        self.hf = fn is not None and takes_eval_prediction(fn)
        self.preprocess = getattr(module, "preprocess_logits_for_metrics", None)
        if self.preprocess is not None and not callable(self.preprocess):
            raise ModuleContractError(f"{type(module).__name__}.preprocess_logits_for_metrics is a "
                                      f"{type(self.preprocess).__name__}: make it a function (logits, labels) -> logits")
        model = getattr(module, "model", module)
        config = getattr(model, "config", None)
        self.ignored = {*IGNORED_OUTPUTS, *(getattr(config, "keys_to_ignore_at_inference", None) or ())}
        self.input_name = getattr(model, "main_input_name", "input_ids")
        self.inputs = self.hf and "inputs" in include
        self.losses = self.hf and "loss" in include

    @property
    def packs(self) -> bool:
        """Whether the labels kept travel with the inputs and/or losses (``unpack`` splits them)."""
        return self.inputs or self.losses

    def predictions(self, pred: Any, label: Any) -> Any:
        """One batch's predictions, as compute_metrics gets them (class docstring)."""
        if self.hf and isinstance(pred, Mapping):
            kept = tuple(v for k, v in pred.items() if k not in self.ignored and v is not None)
            pred = kept[0] if len(kept) == 1 else kept
        if self.preprocess is not None:
            pred = self.preprocess(pred, label)
        return pred

    def labels(self, label: Any, batch: Any, loss: Any, n: Any) -> Any:
        """One batch's labels, with its inputs and its loss per item where ``include`` asks."""
        if not self.packs:
            return label
        packed = [label]
        if self.inputs:
            if not isinstance(batch, Mapping) or self.input_name not in batch:
                raise DataError(f"include_for_metrics=['inputs'] collects batch[{self.input_name!r}], which the batch "
                                f"does not have (keys {sorted(batch) if isinstance(batch, Mapping) else type(batch)})")
            packed.append(batch[self.input_name])
        if self.losses:
            if loss is None:
                raise ModuleContractError("include_for_metrics=['loss'] needs the module's loss(), which it has not")
            packed.append(loss.detach().float().reshape(1).repeat(int(n)))
        return tuple(packed)

    def unpack(self, label_set: Any) -> tuple[Any, Any, Any]:
        """(labels, inputs, losses) from the joined labels."""
        if not self.packs or label_set is None:
            return label_set, None, None
        rest = iter(label_set[1:])
        return label_set[0], next(rest) if self.inputs else None, next(rest) if self.losses else None


def numpified(value: Any) -> Any:
    """``value`` with every tensor a numpy array (inside tuples, lists and dicts too)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if isinstance(value, (tuple, list)):
        return type(value)(numpified(v) for v in value)
    if isinstance(value, Mapping):
        return {k: numpified(v) for k, v in value.items()}
    return value


def takes_eval_prediction(compute_metrics: Any) -> bool:
    """Whether ``compute_metrics`` (bound) is the HF Trainer's form: exactly one positional
    parameter, and no ``*args`` (``(predictions, labels=None)`` stays lightlike's form)."""
    try:
        params = list(inspect.signature(compute_metrics).parameters.values())
    except (TypeError, ValueError):  # no signature to read: lightlike's form
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return False
    return sum(p.kind in positional for p in params) == 1


def call_compute_metrics(module: Any, predictions: Any, labels: Any, inputs: Any = None, losses: Any = None) -> Any:
    """``module.compute_metrics`` on the whole set: ``(predictions, labels)`` as tensors, or, for
    the HF Trainer's one-argument form, an ``EvalPrediction`` of numpy arrays; what it returns
    must be a dict (or None)."""
    fn = module.compute_metrics
    if takes_eval_prediction(fn):
        result = fn(EvalPrediction(numpified(predictions), numpified(labels), numpified(inputs), numpified(losses)))
    else:
        result = fn(predictions, labels)
    if result is not None and not isinstance(result, Mapping):
        raise ModuleContractError(f"compute_metrics returned a {type(result).__name__}: return a dict of metric names "
                                  "to numbers, e.g. {'accuracy': 0.9} (reported as val/accuracy)")
    return result


def defines_compute_metrics(module: Any, base: Any) -> bool:
    """Whether ``module`` has a ``compute_metrics`` of its own: its class's, or one set on it."""
    return type(module).compute_metrics is not base.compute_metrics or "compute_metrics" in vars(module)

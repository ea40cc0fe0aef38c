"""``compute_metrics`` in the HF Trainer's form: ``compute_metrics(eval_pred)``, one argument with
``eval_pred.predictions`` and ``eval_pred.label_ids`` as numpy arrays.

A module's ``compute_metrics(predictions, labels)`` gets the whole set's tensors, as lightlike
joins them. A ``compute_metrics`` that takes one argument is the HF Trainer's: it gets an
``EvalPrediction`` of numpy arrays instead, so a function written for the Trainer runs unchanged
(as a method, a staticmethod, or set on the module: ``module.compute_metrics = compute_metrics``).
The arrays are made once, at the end of an evaluation, from the joined tensors (bfloat16 as
float32, which numpy lacks, as the Trainer does); padding stays ``PAD_VALUE`` (-100), as there.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch


class EvalPrediction:
    """What an HF-style ``compute_metrics(eval_pred)`` gets: ``predictions`` and ``label_ids``
    (numpy arrays, or tuples/dicts of them as the module's predictions and labels are), read as
    attributes or unpacked, ``predictions, labels = eval_pred``, like transformers' own."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses

    def __iter__(self) -> Iterator[Any]:
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, index: int) -> Any:
        return (self.predictions, self.label_ids)[index]

    def __len__(self) -> int:
        return 2


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


def call_compute_metrics(module: Any, predictions: Any, labels: Any) -> Any:
    """``module.compute_metrics`` on the whole set: ``(predictions, labels)`` as tensors, or, for
    the HF Trainer's one-argument form, an ``EvalPrediction`` of numpy arrays."""
    fn = module.compute_metrics
    if takes_eval_prediction(fn):
        return fn(EvalPrediction(numpified(predictions), numpified(labels)))
    return fn(predictions, labels)


def defines_compute_metrics(module: Any, base: Any) -> bool:
    """Whether ``module`` has a ``compute_metrics`` of its own: its class's, or one set on it."""
    return type(module).compute_metrics is not base.compute_metrics or "compute_metrics" in vars(module)

"""``torchmetrics`` objects as lightlike streaming metrics, exact on any number of processes.

Return torchmetrics objects from ``TaskModule.streaming_metrics()`` and set
``eval_streaming=True``::

    def __init__(self):
        ...
        self.f1 = MulticlassF1Score(num_classes=10)      # a submodule: it follows the device

    def streaming_metrics(self):
        return {"f1": self.f1}                           # reported as "val/f1"

Every evaluation resets the metric, calls ``metric.update(predictions, labels)`` per batch
(``TaskModule.predictions(outputs, batch)`` and ``TaskModule.labels(batch)``; wrap the metric in
``TorchMetric(metric, inputs=...)`` to pass something else) and ``metric.compute()`` at the end.
On several processes each rank updates with its own share of the evaluation set and
``compute()`` reduces the metric *states* over all ranks (torchmetrics' own synchronisation:
summed counts, concatenated lists), so the value is the whole-set value, equal on every rank and
to a one-process run, whatever the split, as long as an update does not depend on its batch:
feed probabilities, not logits (torchmetrics softmaxes or sigmoids a batch only when one of its
values lies outside [0, 1], so a small batch of logits in [0, 1] is taken as probabilities; the
inputs are passed on unchanged). A ``MetricCollection`` contributes one value per member, under
the collection's keys; the metrics inside a composition (``metric + 0.0``) or a wrapper are
checked and synchronised as the outer one.

This module does not import torchmetrics: an object is recognised as a torchmetrics metric only
when torchmetrics is already imported (it must be, for the object to exist).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightlike.errors import ModuleContractError
from lightlike.module import TaskModule


class TorchMetric:
    """Adapts a ``torchmetrics.Metric`` to the streaming-metric protocol (``reset``,
    ``update(outputs, batch)``, ``compute()``).

    ``inputs(outputs, batch)`` returns the positional arguments of ``metric.update``; default:
    ``(module.predictions(outputs, batch), module.labels(batch))`` of the module it is bound to
    (plain ``(outputs, batch["labels"])`` style when unbound)."""

    #: ``compute()`` reduces the states of every rank: the evaluation may run on several processes
    reduces_across_ranks = True

    def __init__(self, metric: Any, inputs: Callable[[Any, Any], tuple] | None = None, module: Any = None):
        if not _is_torchmetric(metric):
            raise ModuleContractError(f"TorchMetric wraps a torchmetrics.Metric, got {type(metric).__name__}")
        # a composition (``metric + 0.0``) or a wrapper holds the metrics that reduce across ranks
        # inside: each of them (and the outer one) is checked and gathers with gather_states
        inner = [m for m in metric.modules() if _is_torchmetric(m)]
        for m in inner:
            if getattr(m, "sync_on_compute", True) is False:
                within = "" if m is metric else f" inside {type(metric).__name__}"
                raise ModuleContractError(
                    f"{type(m).__name__}(sync_on_compute=False){within} would report each process's own share "
                    "of the evaluation set; leave sync_on_compute at its default (True)")
        for m in inner:
            if getattr(m, "dist_sync_fn", None) is None:
                m.dist_sync_fn = gather_states  # a rank without a share of the set joins with an empty state
        self.metric = metric
        self.inputs = inputs
        self.module = module

    def reset(self) -> None:
        self.metric.reset()

    def update(self, outputs: Any, batch: Any) -> None:
        args = self.inputs(outputs, batch) if self.inputs is not None else self._default_inputs(outputs, batch)
        device = next((a.device for a in args if hasattr(a, "device")), None)
        if device is not None and self.metric.device != device:
            self.metric.to(device)  # states follow the outputs (a metric built outside the module)
        self.metric.update(*args)

    def compute(self) -> Any:
        # torchmetrics gathers and reduces the states over the default process group (the one
        # lightlike's strategies evaluate on), then restores this rank's local states
        return self.metric.compute()

    def _default_inputs(self, outputs: Any, batch: Any) -> tuple:
        if self.module is not None:
            labels = self.module.labels(batch)
            preds = self.module.predictions(outputs, batch)
        else:
            labels = TaskModule.labels(None, batch)  # type: ignore[arg-type]
            preds = outputs
        if labels is None:
            raise ModuleContractError(
                f"cannot update {type(self.metric).__name__}: the batch has no labels (keys labels/label/y/"
                "target/targets); override TaskModule.labels(batch) or wrap the metric as "
                "TorchMetric(metric, inputs=lambda outputs, batch: (preds, target))")
        return preds, labels


def gather_states(state: Any, group: Any = None) -> list[Any]:
    """torchmetrics' ``dist_sync_fn``: every rank's copy of one state tensor. Unlike torchmetrics'
    default it takes states of different shapes: a rank that saw no item of an evaluation set
    smaller than the world holds a list state as an empty 1-D float tensor while the others hold
    ``[N, C]`` ones, which made the default's shape exchange mismatch and abort every rank. Such
    an empty state comes back shaped ``(0, C...)`` with the others' dtype, so it concatenates."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, state.detach().cpu(), group=group)
    like = next((t for t in gathered if t.numel()), gathered[0])
    out = []
    for t in gathered:
        if t.numel() == 0 and (t.shape != like.shape or t.dtype != like.dtype):
            t = torch.empty((0, *like.shape[1:]), dtype=like.dtype)
        out.append(t.to(state.device))
    return out


def adapt_streaming_metrics(streams: Mapping[str, Any], module: Any) -> dict[str, Any]:
    """What ``streaming_metrics()`` returned, with torchmetrics objects wrapped in ``TorchMetric``
    (a ``MetricCollection`` expanded into its members); other objects pass as they are."""
    out: dict[str, Any] = {}
    for name, s in streams.items():
        if isinstance(s, TorchMetric):
            if s.module is None:
                s.module = module
            out[name] = s
        elif _is_collection(s):
            for key, member in s.items(keep_base=False, copy_state=True):
                out[str(key)] = TorchMetric(member, module=module)
        elif _is_torchmetric(s):
            out[name] = TorchMetric(s, module=module)
        else:
            out[name] = s
    return out


def _is_torchmetric(obj: Any) -> bool:
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.Metric)


def _is_collection(obj: Any) -> bool:
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.MetricCollection)


__all__ = ["TorchMetric", "adapt_streaming_metrics"]

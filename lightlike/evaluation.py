"""Evaluation and prediction: exact, item-weighted reductions over whole datasets.

Additive metrics (``TaskModule.metrics``, and the loss) are per-batch means; the running sums
``mean * num_items`` are kept on the device in float64 and divided once at the end, so the
result is the exact dataset mean, not a mean of batch means. Non-additive metrics go through
``compute_metrics(predictions, labels)`` on the whole set, or through streaming metric
objects (``eval_streaming=True``, or whenever the module defines only those).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightlike.errors import ConfigError, DataError, ModuleContractError

if TYPE_CHECKING:
    from lightlike.strategies import Strategy


def check_loss(loss: Any, where: str, *where_args: Any) -> torch.Tensor:
    """The loss must be a scalar tensor; host-side check only (no device sync). ``where`` is
    formatted with ``where_args`` only when there is an error to report."""
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss
    where = where.format(*where_args)
    if not isinstance(loss, torch.Tensor):
        raise ModuleContractError(
            f"loss() returned {type(loss).__name__} {where}; return a scalar torch.Tensor "
            "(the mean over the batch's items)"
        )
    if loss.ndim != 0:
        raise ModuleContractError(
            f"loss() returned a tensor of shape {tuple(loss.shape)} {where}; return a scalar "
            "(e.g. .mean() over the batch's items)"
        )
    return loss


def call_module(model: Any, batch: Any, where: str, *where_args: Any) -> Any:
    """``model(batch)``, turning a missing batch key into an error that names it."""
    try:
        return model(batch)
    except KeyError as e:
        where = where.format(*where_args)
        keys = sorted(batch.keys()) if isinstance(batch, Mapping) else None
        have = f"; the batch has keys {keys}" if keys is not None else ""
        raise DataError(
            f"the module read batch key {e.args[0]!r} {where}, which the batch does not have{have}. "
            "Fix the dataset/collate_fn or the key the module reads"
        ) from e


def _metric_tensors(values: Any, device: torch.device, where: str) -> dict[str, torch.Tensor]:
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ModuleContractError(f"metrics() must return a dict of scalars {where}, got {type(values).__name__}")
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ModuleContractError(
                    f"metrics()[{k!r}] is a tensor of shape {tuple(v.shape)} {where}; return a scalar "
                    "per-batch mean (put whole-set metrics in compute_metrics)"
                )
            out[k] = v.detach().reshape(())
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = torch.tensor(float(v), device=device)
        else:
            raise ModuleContractError(f"metrics()[{k!r}] is a {type(v).__name__} {where}; return a scalar")
    return out


def _concat(chunks: list[Any]) -> Any:
    if not chunks:
        return None
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([c.reshape(1) if c.ndim == 0 else c for c in chunks])
    if isinstance(first, Mapping):
        return {k: _concat([c[k] for c in chunks]) for k in first}
    out: list[Any] = []
    for c in chunks:
        out.extend(c if isinstance(c, (list, tuple)) else [c])
    return out


def _detach_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    if isinstance(x, Mapping):
        return {k: _detach_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_detach_cpu(v) for v in x)
    return x


@torch.no_grad()
def run_evaluation(
    model: Any,
    module: Any,
    loader: Any,
    strategy: Strategy,
    prefix: str,
    *,
    streaming: bool = False,
    keep_outputs: bool = False,
) -> tuple[dict[str, float], Any, Any]:
    """Evaluate one set. Returns ``(metrics, predictions, labels)``; predictions/labels are
    collected (on CPU, in dataset order) when ``keep_outputs`` or when the module defines
    ``compute_metrics`` and streaming is off."""
    device = strategy.root_device
    was_training = model.training
    model.eval()
    base = _base_module()
    wants_whole_set = type(module).compute_metrics is not base.compute_metrics
    # a module with streaming metrics and no compute_metrics streams without being asked: its
    # metrics are never dropped because eval_streaming was left off
    streaming = streaming or (type(module).streaming_metrics is not base.streaming_metrics and not wants_whole_set)
    collect = keep_outputs or (wants_whole_set and not streaming)
    streams = module.streaming_metrics() if streaming else None
    if streams:  # torchmetrics objects are wrapped to reduce across ranks (lightlike/interop/metrics.py)
        from lightlike.interop.metrics import adapt_streaming_metrics

        streams = adapt_streaming_metrics(streams, module)
    if streams and strategy.world_size > 1 and not all(getattr(s, "reduces_across_ranks", False) for s in streams.values()):
        raise ConfigError("streaming metrics on several processes must reduce across ranks (torchmetrics "
                          "objects do; set reduces_across_ranks = True on your own), or define compute_metrics "
                          "instead (outputs are gathered in dataset order)")
    if streams:
        for s in streams.values():
            s.reset()
    sums: dict[str, torch.Tensor] = {}
    items = torch.zeros((), dtype=torch.float64, device=device)
    keys: set[str] | None = None
    preds: list[Any] = []
    labels: list[Any] = []
    n_batches = 0
    try:
        for i, batch in enumerate(loader):
            where = f"in {prefix} batch {i}"
            batch = strategy.batch_to_device(batch)
            with strategy.autocast():
                outputs = call_module(model, batch, where)
                loss = check_loss(module.loss(outputs, batch), where)
                values = _metric_tensors(module.metrics(outputs, batch), device, where)
            if keys is None:
                keys = set(values)
            elif set(values) != keys:
                raise ModuleContractError(
                    f"metrics() returned keys {sorted(values)} {where} but {sorted(keys)} before; "
                    "return the same keys for every batch"
                )
            n = module.num_items(batch)
            n_t = n.to(torch.float64) if isinstance(n, torch.Tensor) else torch.tensor(float(n), dtype=torch.float64, device=device)
            items += n_t
            values = {"loss": loss.detach(), **values}
            for k, v in values.items():
                contrib = v.to(torch.float64) * n_t
                sums[k] = sums[k] + contrib if k in sums else contrib
            if streams:
                for s in streams.values():
                    s.update(outputs, batch)
            if collect:
                preds.append(_detach_cpu(module.predictions(outputs, batch)))
                labels.append(_detach_cpu(module.labels(batch)))
            n_batches += 1
    finally:
        model.train(was_training)
    if n_batches == 0:
        raise DataError(f"the {prefix} data produced no batches: pass a non-empty dataset")
    total = strategy.all_reduce(items)
    names = sorted(sums)
    stacked = strategy.all_reduce(torch.stack([sums[k] for k in names])) / total
    metrics = {f"{prefix}/{k}": float(v) for k, v in zip(names, stacked.tolist(), strict=True)}
    predictions = strategy.gather_in_order(_concat(preds)) if collect else None
    label_set = None
    if collect and any(x is not None for x in labels):
        label_set = strategy.gather_in_order(_concat([x for x in labels if x is not None]))
    if wants_whole_set and not streaming:
        extra = module.compute_metrics(predictions, label_set) or {}
        metrics.update({f"{prefix}/{k}": _as_float(v, k) for k, v in extra.items()})
    if streams:
        metrics.update({f"{prefix}/{k}": _as_float(s.compute(), k) for k, s in streams.items()})
    return metrics, predictions, label_set


def _as_float(v: Any, key: str) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ModuleContractError(f"whole-set metric {key!r} is not a scalar (shape {tuple(v.shape)})")
        return float(v.item())
    try:
        return float(v)
    except (TypeError, ValueError) as e:
        raise ModuleContractError(f"whole-set metric {key!r} is a {type(v).__name__}, not a number") from e


def _base_module() -> Any:
    from lightlike.module import TaskModule

    return TaskModule


def is_improvement(value: float, best: float | None, greater_is_better: bool, min_delta: float = 0.0) -> bool:
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best + min_delta if greater_is_better else value < best - min_delta

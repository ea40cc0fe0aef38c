"""Evaluation and prediction: exact, item-weighted reductions over whole datasets.

Additive metrics (``TaskModule.metrics``, and the loss) are per-batch means; the running sums
``mean * num_items`` are kept on the device in float64 and divided once at the end, so the
result is the exact dataset mean, not a mean of batch means. Non-additive metrics go through
``compute_metrics(predictions, labels)`` on the whole set, or through streaming metric
objects (``eval_streaming=True``, or whenever the module defines only those).

Unlabelled data: ``predict`` computes the loss and metrics only for batches that
``TaskModule.labels(batch)`` says carry labels (not None); on data without labels it returns the
predictions, ``labels=None`` and no metrics. ``validate``/``test`` always compute the loss.

Whole-set predictions and labels are joined along the batch dimension; tensors whose other
dimensions differ between batches or ranks (token logits ``[B, T_i, V]``) are padded to the
largest with ``PAD_VALUE`` (-100, as the HF Trainer does; False for bool, 0 for unsigned
integers). A rank whose share of a small set is empty contributes nothing and joins every
collective; only a set that is empty on every rank is an error.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import logging
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from lightlike.best import greater_is_better, is_improvement  # noqa: F401  (also lightlike.evaluation's)
from lightlike.data.limits import capped, limited
from lightlike.data.workers import start_workers
from lightlike.errors import ConfigError, DataError, LightlikeError, ModuleContractError, on_every_rank
from lightlike.eval_prediction import TrainerForm, call_compute_metrics, defines_compute_metrics
from lightlike.interop.metrics import adapt_streaming_metrics
from lightlike.module import TaskModule, batch_length
from lightlike.outputs import (  # noqa: F401  (PAD_VALUE: also lightlike.evaluation.PAD_VALUE)
    PAD_VALUE,
    concat,
    conform,
    detach_cpu,
    in_batch_order,
    leaf_rows,
    merge_specs,
    restore,
    rows_only,
    spec_of,
)
from lightlike.preemption import waiting_for

if TYPE_CHECKING:
    from lightlike.strategies import Strategy

log = logging.getLogger("lightlike")


def check_loss(loss: Any, where: str, *where_args: Any) -> torch.Tensor:
    """The loss must be a scalar tensor; host-side check only (no device sync). ``where`` is
    formatted with ``where_args`` only when there is an error to report."""
    if isinstance(loss, torch.Tensor) and loss.ndim == 0 and (loss.requires_grad or not torch.is_grad_enabled()):
        return loss
    where = where.format(*where_args)
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        raise ModuleContractError(
            f"loss() returned a tensor that does not require grad {where}, so nothing can be learnt from "
            "it: compute it from the outputs with torch operations (no .item(), .detach() or torch.tensor(...)), "
            "and leave some parameters trainable"
        )
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
    except (KeyError, TypeError) as e:
        if (error := _batch_error(e, batch, "the module", where, where_args)) is None:
            raise  # the module's own error (a KeyError of a dict attribute, say): not the batch's fault
        raise error from e


def call_loss(module: Any, outputs: Any, batch: Any, where: str, *where_args: Any) -> torch.Tensor:
    """``module.loss(outputs, batch)``, checked to be a scalar tensor (``check_loss``); a batch
    key the loss reads and the batch lacks raises a ``DataError`` naming it."""
    try:
        loss = module.loss(outputs, batch)
    except Exception as e:
        if (error := _loss_error(e, outputs, batch, "loss()", where, where_args)) is None:
            raise
        raise error from e
    if type(loss) is torch.Tensor and loss.ndim == 0 and loss.requires_grad:  # the usual loss, checked in place
        return loss
    return check_loss(loss, where, *where_args)


_NOT_YET = object()  # forward has not returned


def defines_loss(module: Any) -> bool:
    """Whether ``module`` has a ``loss``: every module but one with ``training_step`` that defines none."""
    return type(module).loss is not _base_module().loss or not callable(getattr(module, "training_step", None))


def forward_loss(model: Any, module: Any, batch: Any, where: str, *where_args: Any) -> torch.Tensor:
    """``module.loss(model(batch), batch)`` for a training micro-batch, with ``call_module``'s and
    ``call_loss``'s errors and checks, in one call (the loop makes it once per micro-batch)."""
    who, outputs = "the module", _NOT_YET
    try:
        outputs = model(batch)
        who = "loss()"
        loss = module.loss(outputs, batch)
    except Exception as e:
        if (error := _loss_error(e, outputs, batch, who, where, where_args)) is None:
            raise
        raise error from e
    if type(loss) is torch.Tensor and loss.ndim == 0 and loss.requires_grad:  # the usual loss, checked in place
        return loss
    return check_loss(loss, where, *where_args)


def error_naming_the_batch(e: Exception, batch: Any, who: str, where: str, *where_args: Any) -> Exception | None:
    """The ``DataError`` naming what ``batch`` lacks, for ``e`` raised by ``who`` ("the module",
    "loss()", "metrics()") reading it, or None where ``e`` is not about the batch (the compiled
    step's errors: ``lightlike/compiled.py``)."""
    return _loss_error(e, _NOT_YET, batch, who, where, where_args)


def _loss_error(e: Exception, outputs: Any, batch: Any, who: str, where: str, where_args: tuple) -> Exception | None:
    """The error to raise for ``e``, raised by ``who`` (the module's forward or ``loss()``): a
    forward that returned None, when the loss then failed (the loss reads outputs it has not
    got), or a batch read (``_batch_error``); None where ``e`` is the module's own error."""
    if outputs is None and who == "loss()":
        return ModuleContractError(f"forward() returned None {where.format(*where_args)}, and loss() failed on it "
                                   f"({type(e).__name__}: {e}): return the outputs loss() reads (e.g. the logits, "
                                   "or the model's output object) from forward()")
    if isinstance(e, (KeyError, TypeError)):
        return _batch_error(e, batch, who, where, where_args)
    return None


def _batch_error(e: KeyError | TypeError, batch: Any, who: str, where: str, where_args: tuple) -> Exception | None:
    """The error naming what ``batch`` lacks, for a read of it by ``who`` that raised ``e``; None
    where ``e`` is not about the batch (then it propagates as it is)."""
    if isinstance(e, KeyError):
        return _missing_key_error(e, batch, who, where, where_args) if _missing_key(e, batch) else None
    return _sequence_read_error(e, batch, who, where, where_args)


def call_hook(hook: Callable[..., Any], name: str, batch: Any, where: str, *args: Any) -> Any:
    """``hook(*args)`` (``metrics``, ``labels``, ...) with ``call_module``'s missing-key error."""
    try:
        return hook(*args)
    except KeyError as e:
        if not _missing_key(e, batch):
            raise
        raise _missing_key_error(e, batch, f"{name}()", where, ()) from e


def _missing_key(e: KeyError, batch: Any) -> bool:
    """Whether ``e`` is a read of a key that ``batch`` (a mapping) does not have: the key is
    absent from the batch, and the subscript that raised, where the source shows it, is on the
    batch (``self.table["b"]`` on a dict attribute is the module's own error)."""
    if not isinstance(batch, Mapping) or len(e.args) != 1:
        return False
    try:
        if e.args[0] in batch:
            return False
    except TypeError:  # an unhashable key: not a batch lookup
        return False
    known, container = _subscripted(e, batch)
    return known and _same_batch(container, batch)  # not provably a read of the batch: the module's own


def _same_batch(obj: Any, batch: Mapping) -> bool:
    """``batch`` or a copy of it (a wrapper such as DDP on CUDA moves the batch into a new dict)."""
    if obj is batch:
        return True
    try:
        return isinstance(obj, Mapping) and obj.keys() == batch.keys()
    except Exception:  # an odd mapping: not provably the batch
        return False


def _subscripted(e: BaseException, batch: Any) -> tuple[bool, Any]:
    """``(True, obj)`` when the innermost frame outside the batch's own methods (a mapping class
    written in Python) raised ``e`` at ``obj[...]`` and ``obj`` is a plain name or attribute path
    there (read without running code: no properties); else ``(False, None)``."""
    entries = []
    tb = e.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while entries and _same_batch(entries[-1].tb_frame.f_locals.get("self"), batch):
        entries.pop()  # inside the batch's __getitem__: the read is the caller's
    if not entries:
        return False, None
    tb = entries[-1]
    frame = tb.tb_frame
    try:
        line, end_line, col, end_col = list(frame.f_code.co_positions())[tb.tb_lasti // 2]
        if line is None or end_line is None or col is None or end_col is None:
            return False, None
        lines = [s.encode() for s in linecache.getlines(frame.f_code.co_filename, frame.f_globals)[line - 1:end_line]]
        text = (lines[0][col:end_col] if len(lines) == 1 else
                b"".join([lines[0][col:], *lines[1:-1], lines[-1][:end_col]])).decode()
        node = ast.parse(f"({text})", mode="eval").body
    except (IndexError, ValueError, SyntaxError, UnicodeDecodeError, AttributeError):  # co_positions: 3.11+
        return False, None
    if not isinstance(node, ast.Subscript):
        return False, None
    return _resolve(node.value, frame)


def _resolve(node: ast.expr, frame: Any) -> tuple[bool, Any]:
    if isinstance(node, ast.Name):
        for scope in (frame.f_locals, frame.f_globals):
            if node.id in scope:
                return True, scope[node.id]
        return False, None
    if isinstance(node, ast.Attribute):
        known, obj = _resolve(node.value, frame)
        if known:
            try:
                value = inspect.getattr_static(obj, node.attr)
            except AttributeError:
                return False, None
            if not hasattr(type(value), "__get__"):  # a plain value, not a property or method
                return True, value
    return False, None


def _missing_key_error(e: KeyError, batch: Mapping, who: str, where: str, where_args: Any) -> DataError:
    where = where.format(*where_args)
    return DataError(
        f"{who} read batch key {e.args[0]!r} {where}, which the batch does not have; the batch has "
        f"keys {sorted(batch.keys(), key=str)}. Fix the dataset/collate_fn or the key {who} reads"
    )


def _sequence_read_error(e: TypeError, batch: Any, who: str, where: str, where_args: Any) -> DataError | None:
    """A batch that is a tuple/list or a tensor, read by key (``batch["x"]``): say so, naming the read."""
    as_tensor = isinstance(batch, torch.Tensor) and "invalid data type 'str'" in str(e)
    if not as_tensor and (not isinstance(batch, (list, tuple)) or "indices must be integers" not in str(e)):
        return None
    known, container = _subscripted(e, batch)
    if not (known and container is batch):
        return None
    if as_tensor:
        return DataError(
            f"{who} read the batch by key {where.format(*where_args)}, but the batch is a tensor of shape "
            f"{tuple(batch.shape)}, not a mapping (a tensor given as the dataset is a dataset of its rows): use "
            "the batch as a tensor, or give a dataset whose items are dicts ({'x': ..., 'y': ...})")
    return DataError(
        f"{who} read the batch by key {where.format(*where_args)}, but the batch is a {type(batch).__name__} of "
        f"{len(batch)} elements, not a mapping: index it by position (batch[0]) or let the dataset return dicts"
    )


_END = object()


def _agree(infos: list[Any], prefix: str) -> tuple[list[str], bool, Any, Any]:
    """From every rank's ``(batches, metric names, labelled, prediction spec, label spec)``: the
    names, whether labelled, and the specs every rank pads its parts to."""
    active = [info for info in infos if info[0]]
    if not active:
        raise DataError(f"the {prefix} data produced no batches on any of the {len(infos)} processes: "
                        "pass a non-empty dataset")
    if len({tuple(info[1]) for info in active}) > 1:
        raise ModuleContractError(f"metrics() returned different keys on different ranks "
                                  f"({sorted({tuple(info[1]) for info in active})}); return the same keys everywhere")
    if len({info[2] for info in active}) > 1:
        raise DataError(f"the {prefix} batches have labels on some ranks and none on others "
                        "(TaskModule.labels(batch)); predict on a set that is labelled throughout or not at all")
    return (list(active[0][1]), active[0][2], merge_specs([info[3] for info in infos], "predictions"),
            merge_specs([info[4] for info in infos], "labels"))


def _in_lockstep(batches: Iterator[Any], strategy: Strategy) -> Iterator[tuple[Any, bool]]:
    """``(batch, True)`` for each of this rank's batches, then ``(stand_in, False)`` until every
    rank's share is done: all ranks run the same number of forwards. The stand-in is this rank's
    last batch, or, for a rank whose share is empty, the first batch of the lowest rank that has
    one (sent once). One small all-gather per batch: only for strategies whose forward is
    collective, where each forward gathers parameters anyway."""
    stand_in: Any = _END
    while True:
        batch = next(batches, _END)
        have = batch is not _END
        if have:
            stand_in = batch
        states = strategy.collectives.all_gather_object((have, stand_in is not _END))
        if not any(h for h, _ in states):
            return
        if not all(s for _, s in states):  # some rank never had a batch: the first one there is, sent
            src = next(r for r, (h, _) in enumerate(states) if h)
            sent = strategy.collectives.broadcast_object(batch if strategy.global_rank == src else None, src=src)
            if stand_in is _END:
                stand_in = sent
        yield (batch, True) if have else (stand_in, False)


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
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):  # also numpy scalars (np.float32)
            out[k] = torch.tensor(float(v), device=device)
        else:
            raise ModuleContractError(f"metrics()[{k!r}] is a {type(v).__name__} {where}; return a scalar")
    return out


class _Tally:
    """One rank's running sums and kept outputs for one evaluation set: item-weighted metric
    sums and the item count on the device (float64), predictions and labels on the CPU."""

    def __init__(self, device: torch.device, prefix: str):
        self.device, self.prefix = device, prefix
        self.sums: dict[str, torch.Tensor] = {}
        self.items = torch.zeros((), dtype=torch.float64, device=device)
        self.keys: set[str] | None = None
        self.preds: list[Any] = []
        self.labels: list[Any] = []
        self.n_batches = 0
        self.labelled: bool | None = None  # whether this rank's batches carry labels (all or none)

    def note_labelled(self, has_label: bool, i: int) -> None:
        if self.labelled is None:
            self.labelled = has_label
        elif self.labelled != has_label:
            raise DataError(f"{self.prefix} batch {i} {'has' if has_label else 'has no'} labels but the batches "
                            f"before it {'do not' if has_label else 'do'} (TaskModule.labels(batch)); "
                            "predict on a set that is labelled throughout or not at all")

    def add(self, loss: torch.Tensor | None, values: dict[str, torch.Tensor], n: Any, where: str) -> None:
        """One batch's loss and metrics (per-batch means), weighted by its ``n`` items."""
        if self.keys is None:
            self.keys = set(values)
        elif set(values) != self.keys:
            raise ModuleContractError(f"metrics() returned keys {sorted(values)} {where} but {sorted(self.keys)} "
                                      "before; return the same keys for every batch")
        n_t = (n.to(torch.float64) if isinstance(n, torch.Tensor)
               else torch.tensor(float(n), dtype=torch.float64, device=self.device))
        self.items += n_t
        for k, v in ({"loss": loss.detach(), **values} if loss is not None else values).items():
            contrib = v.to(torch.float64) * n_t
            self.sums[k] = self.sums[k] + contrib if k in self.sums else contrib


def _streams_for(module: Any, strategy: Strategy, streaming: bool) -> tuple[bool, Any, bool]:
    """``(streaming, streams, wants_whole_set)`` for ``module``: whether its metrics stream, the
    streaming metric objects (reset, wrapped to reduce across ranks), and whether it defines
    ``compute_metrics``."""
    base = _base_module()
    wants_whole_set = defines_compute_metrics(module, base)
    # a module with streaming metrics and no compute_metrics streams without being asked: its
    # metrics are never dropped because eval_streaming was left off
    streaming = streaming or (type(module).streaming_metrics is not base.streaming_metrics and not wants_whole_set)
    streams = module.streaming_metrics() if streaming else None
    if streaming and wants_whole_set and not streams:
        # nothing streams compute_metrics' values: hold the outputs rather than drop them
        _warn_once(type(module), f"eval_streaming=True but {type(module).__name__} has compute_metrics and no "
                   "streaming_metrics(): its outputs are held for compute_metrics as without eval_streaming. "
                   "Define streaming_metrics() to stream them, or drop eval_streaming=True")
        streaming = False
    if streams:  # torchmetrics objects are wrapped to reduce across ranks (lightlike/interop/metrics.py)
        streams = adapt_streaming_metrics(streams, module)
        if strategy.world_size > 1 and not all(getattr(s, "reduces_across_ranks", False) for s in streams.values()):
            raise ConfigError("streaming metrics on several processes must reduce across ranks (torchmetrics "
                              "objects do; set reduces_across_ranks = True on your own), or define compute_metrics "
                              "instead (outputs are gathered in dataset order)")
        for s in streams.values():
            s.reset()
    return streaming, streams, wants_whole_set


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
    compiled: Any = None,
    on_batch: Callable[[str, int, int | None], None] | None = None,
    include: Any = (),
    limit: int | None = None,
) -> tuple[dict[str, float], Any, Any]:
    """Evaluate one set. Returns ``(metrics, predictions, labels)``; predictions/labels are
    collected (on CPU, in dataset order) when ``keep_outputs`` (predict) or when the module
    defines ``compute_metrics`` and streaming is off. With ``keep_outputs``, batches whose
    ``labels(batch)`` is None are unlabelled: no loss, no metrics, only predictions.
    ``compiled``: a fit's ``CompiledStep`` (``compile=True``), which computes forward, loss and
    metrics as one compiled function. ``on_batch(prefix, i, num_batches)``: called after each of
    this rank's batches (the callbacks' ``on_eval_batch_end``; a progress bar). ``include``:
    ``FitConfig.include_for_metrics`` (``TrainerForm``: what an HF ``compute_metrics`` gets). ``limit``:
    this rank's first batches only (``limit_val_batches``, ``lightlike/data/limits.py``)."""
    num_batches = capped(_num_batches(loader), limit) if on_batch is not None else None
    streaming, streams, wants_whole_set = _streams_for(module, strategy, streaming)
    collect = keep_outputs or (wants_whole_set and not streaming)
    tally = _Tally(strategy.root_device, prefix)
    form = TrainerForm(module, include) if collect else None
    # the mode comes back as it was: train(mode) of the user's module's (not a wrapper's) flag,
    # which runs a train() override, then each submodule that was in another mode than that
    # (a frozen BatchNorm in a training module) set back as it was
    was_training = module.training
    modes = [(m, m.training) for m in {*model.modules(), *module.modules()}]
    with strategy.evaluating(model) as model:
        model.eval()
        try:
            batches = limited(waiting_for(start_workers(loader), f"the {prefix!r} evaluation DataLoader's next batch"),
                              limit)
            for i, (batch, real) in enumerate(_in_lockstep(batches, strategy) if strategy.forward_is_collective
                                              else ((b, True) for b in batches)):
                _evaluate_batch(model, module, strategy, strategy.batch_to_device(batch), real, i, tally,
                                streams, form, keep_outputs, compiled)
                if on_batch is not None and real:
                    on_batch(prefix, i, num_batches)
        finally:
            model.train(was_training)  # the module's own train() runs, as eval() did
            for m, mode in modes:
                if m.training != mode:  # a submodule in another mode than its parent (a frozen norm)
                    m.training = mode
    metrics, predictions, label_set = _joined(tally, loader, strategy, collect)
    label_set, inputs, losses = form.unpack(label_set) if form is not None else (label_set, None, None)
    if tally.labelled and wants_whole_set and not streaming:  # HF's compute_metrics(eval_pred) too
        extra = call_compute_metrics(module, predictions, label_set, inputs, losses) or {}
        _merge(metrics, {f"{prefix}/{k}": _as_float(v, k) for k, v in extra.items()}, module, "compute_metrics()")
    if streams and tally.labelled:
        _merge(metrics, {f"{prefix}/{k}": _as_float(s.compute(), k) for k, s in streams.items()}, module,
               "streaming_metrics()")
    return metrics, predictions, label_set


def _merge(metrics: dict[str, float], more: dict[str, float], module: Any, source: str) -> None:
    """``more`` into ``metrics``; a key both give is ``source``'s, with a warning (once per
    module class and key): a per-batch value replaced without a word would be misread."""
    for key in sorted(more.keys() & metrics.keys()):
        _warn_once((type(module), key), f"{source} of {type(module).__name__} gives {key!r}, which loss/metrics() "
                   f"give too: {source}'s value is the one reported; rename one of them to keep both")
    metrics.update(more)


def _num_batches(loader: Any) -> int | None:
    """This rank's batches in ``loader``; None when it has no length (an IterableDataset)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _evaluate_batch(model: Any, module: Any, strategy: Strategy, batch: Any, real: bool, i: int, tally: _Tally,
                    streams: Any, form: TrainerForm | None, keep_outputs: bool, compiled: Any = None) -> None:
    """One batch: forward; loss and metrics into ``tally`` when it is labelled; its predictions
    and labels kept when ``form`` (how they are kept) is given. A stand-in batch (``real=False``: this rank's share is
    done) only runs a forward whose output is dropped, to keep the others' gathers company."""
    where = f"in {tally.prefix} batch {i}"
    if not real:
        with strategy.precision.autocast():
            if compiled is None:
                call_module(model, batch, where)
            else:
                compiled.evaluate(model, batch, False, where)
        return
    collect = form is not None
    label = call_hook(module.labels, "labels", batch, where, batch) if collect else None
    loss = None
    # the default labels() reads mappings only: a tuple batch counts as labelled unless the
    # module's own labels() says otherwise
    default_labels = type(module).labels is _base_module().labels
    has_label = label is not None or not keep_outputs or (default_labels and not isinstance(batch, Mapping))
    tally.note_labelled(has_label, i)
    with strategy.precision.autocast():
        if compiled is not None:  # forward, loss and metrics in one compiled function
            outputs, loss, values = compiled.evaluate(model, batch, has_label, where)
        else:
            outputs = call_module(model, batch, where)
            if has_label:
                # a module with training_step (manual optimization) may define no loss: metrics only
                loss = call_loss(module, outputs, batch, where) if defines_loss(module) else None
                values = call_hook(module.metrics, "metrics", batch, where, outputs, batch)
        if has_label:
            values = _metric_tensors(values, tally.device, where)
    if has_label:
        tally.add(loss, values, call_hook(module.num_items, "num_items", batch, where, batch), where)
        if streams:
            for s in streams.values():
                s.update(outputs, batch)
    if form is not None:
        pred = call_hook(module.predictions, "predictions", batch, where, outputs, batch)
        tally.preds.append(detach_cpu(rows_only(form.predictions(pred, label), where)))
        if label is not None:
            tally.labels.append(detach_cpu(form.labels(label, batch, loss, batch_length(batch))))
    tally.n_batches += 1


def _joined(tally: _Tally, loader: Any, strategy: Strategy, collect: bool) -> tuple[dict[str, float], Any, Any]:
    """The whole set's item-weighted means and its predictions and labels in dataset order,
    from every rank's ``tally``. The ranks first agree on what each holds, so that a rank whose
    share is empty (a set smaller than the world) joins the same collectives."""
    prefix, names, labelled = tally.prefix, sorted(tally.sums), tally.labelled
    dealt = not getattr(getattr(loader, "dataset", None), "shards_itself", False)
    # a DataLoader with batch_size=None yields ready-made batches, dealt to ranks one per turn
    by_batch = dealt and strategy.world_size > 1 and isinstance(loader, DataLoader) and loader.batch_sampler is None
    pred_local = concat(tally.preds, "predictions") if collect else None
    label_local = concat(tally.labels, "labels")
    pred_spec = label_spec = infos = None
    if strategy.world_size > 1:
        rows = ([leaf_rows(p) for p in tally.preds], [leaf_rows(x) for x in tally.labels]) if by_batch else None
        infos = strategy.collectives.all_gather_object(
            (tally.n_batches, names, labelled, spec_of(pred_local), spec_of(label_local), rows))
        try:  # every rank judges the same gathered values: it raises everywhere or nowhere
            names, labelled, pred_spec, label_spec = _agree(infos, prefix)
        except LightlikeError as error:
            raise on_every_rank(error)  # noqa: B904 (the same error, marked)
        tally.labelled = labelled
        pred_local, label_local = conform(pred_local, pred_spec), conform(label_local, label_spec)
    elif tally.n_batches == 0:
        raise DataError(f"the {prefix} data produced no batches: pass a non-empty dataset")
    metrics: dict[str, float] = {}
    if labelled:
        total = strategy.collectives.all_reduce(tally.items)
        zero = torch.zeros((), dtype=torch.float64, device=tally.device)
        stacked = strategy.collectives.all_reduce(torch.stack([tally.sums.get(k, zero) for k in names])) / total
        metrics = {f"{prefix}/{k}": float(v) for k, v in zip(names, stacked.tolist(), strict=True)}
    # a dataset that shards itself deals its own way: its ranks' outputs are joined rank by rank
    in_order = dealt and not by_batch
    predictions = strategy.collectives.gather_in_order(pred_local, in_order) if collect else None
    label_set = strategy.collectives.gather_in_order(label_local, in_order) if label_local is not None else None
    if by_batch:  # whole batches were dealt round-robin: the joined rows go back in batch order
        predictions = in_batch_order(predictions, [info[5][0] for info in infos]) if collect else None
        label_set = in_batch_order(label_set, [info[5][1] for info in infos]) if label_set is not None else None
    if strategy.world_size > 1:  # the module's own types, from the agreed specs (the same on every rank)
        predictions, label_set = restore(predictions, pred_spec), restore(label_set, label_spec)
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


_warned: set[Any] = set()  # module classes, and (class, metric key) pairs


def _warn_once(key: Any, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _base_module() -> Any:
    return TaskModule

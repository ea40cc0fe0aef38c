"""``TaskModule``: what the user writes (forward, loss, metrics) and nothing about the loop."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightlike.errors import CheckpointError, ModuleContractError
from lightlike.utils.buffers import buffers_kept_on_recompute


class TaskModule(nn.Module):
    """Subclass this: ``forward(batch)``, ``loss(outputs, batch)``, optionally ``metrics``.

    Contract (the Fitter checks it and names what is wrong):

    * ``forward(batch)`` gets the whole batch (a dict, tuple or tensor), returns anything.
    * ``loss(outputs, batch)`` returns a scalar tensor: the **mean** over this batch's items.
    * ``num_items(batch)`` says how many items that mean is over (default: the batch length).
      The Fitter weights every micro-batch by it, so gradient accumulation is exact when
      micro-batches hold different numbers of items (padding tokens, a short last batch).
    * ``metrics(outputs, batch)`` returns a dict of scalar tensors, per-batch means over the same
      items; the Fitter reduces them item-weighted into exact whole-set means.
    * ``compute_metrics(predictions, labels)`` (optional) computes non-additive metrics (F1, AUC)
      on the whole evaluation set; ``streaming_metrics()`` (optional) is its streaming twin.
    * ``training_step(batch, ctx)`` (optional) switches the module to manual optimization: it
      runs its own backward passes and steps the optimizers ``configure_optimizers`` returns;
      ``loss`` is then optional (``lightlike/manual.py``, docs/manual_optimization.md).
    """

    _checkpointing_on = False  # switched by gradient_checkpointing_enable/disable

    def __init__(self) -> None:
        super().__init__()
        self.hparams: dict[str, Any] = {}

    # -- the user's part ---------------------------------------------------------------------
    def forward(self, batch: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define forward(self, batch)")

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(
            f"{type(self).__name__} must define loss(self, outputs, batch) returning a scalar "
            "tensor (the mean over the batch's items)"
        )

    def metrics(self, outputs: Any, batch: Any) -> Mapping[str, torch.Tensor]:
        """Per-batch means of additive metrics. Default: none (the loss is always reported)."""
        return {}

    def num_items(self, batch: Any) -> int | torch.Tensor:
        """How many items ``loss`` averages over. Default: the batch length.

        Return a tensor (e.g. ``(batch["labels"] != -100).sum()``) to count tokens; it stays on
        the device, so counting costs no host synchronisation.
        """
        return batch_length(batch)

    def predictions(self, outputs: Any, batch: Any) -> Any:
        """What ``predict`` returns and ``compute_metrics`` receives for this batch."""
        return outputs

    def labels(self, batch: Any) -> Any:
        """The batch's labels, if any: ``batch['labels']`` or ``batch['y']`` for mappings."""
        if isinstance(batch, Mapping):
            for key in ("labels", "label", "y", "target", "targets"):
                if key in batch:
                    return batch[key]
        return None

    def compute_metrics(self, predictions: Any, labels: Any) -> Mapping[str, float] | None:
        """Whole-set metrics from all predictions (in dataset order). Default: none."""
        return None

    def streaming_metrics(self) -> Mapping[str, Any] | None:
        """Objects with ``update(outputs, batch)``, ``compute() -> float`` and ``reset()`` that
        compute whole-set metrics without holding all outputs. Used when ``eval_streaming=True``,
        and always when the module does not define ``compute_metrics``. torchmetrics objects
        work as they are (``lightlike.interop.metrics``)."""
        return None

    def configure_optimizers(self, config: Any) -> Any:
        """Return an optimizer, or ``(optimizer, scheduler)`` (or Lightning's forms and scheduler
        dict), to take over from the built-in ones. A scheduler steps as in Lightning: at each
        epoch's end unless ``{"scheduler": s, "interval": "step"}`` (docs/optimizers.md). Default:
        None. A module with ``training_step`` returns a list of optimizers (or of such pairs),
        whose schedulers step at each ``ctx.step``."""
        return None

    def checkpoint_keys(self) -> Collection[str] | None:
        """The keys of ``state_dict()`` that checkpoints hold; None (the default): all of them. A
        module that trains a part of a frozen base names that part (``HFCausalLM``/``HFModel``
        around a ``peft.PeftModel``: its adapter, through ``lightlike.checkpoint.frozen.trained_keys``);
        its checkpoints then record the rest by a fingerprint, and a resume onto another base is
        refused (docs/checkpoints.md)."""
        return None

    def gradient_checkpointing_enable(self) -> None:
        """Switch activation checkpointing on. The Fitter calls it at set-up when
        ``gradient_checkpointing=True`` (and ``gradient_checkpointing_disable()`` otherwise).
        Default: ``maybe_checkpoint`` starts recomputing. Override both to switch on a wrapped
        model's own checkpointing instead, as ``HFCausalLM`` does (the Fitter then does not
        check that ``maybe_checkpoint`` is called)."""
        self._checkpointing_on = True

    def gradient_checkpointing_disable(self) -> None:
        """Switch activation checkpointing off (see ``gradient_checkpointing_enable``)."""
        self._checkpointing_on = False

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether activation checkpointing is on. Assigning it calls
        ``gradient_checkpointing_enable()`` or ``gradient_checkpointing_disable()``."""
        return self._checkpointing_on

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        if on:
            self.gradient_checkpointing_enable()
        else:
            self.gradient_checkpointing_disable()

    # -- helpers for the user ------------------------------------------------------------------
    def compile_regions(self) -> list[nn.Module] | None:
        """The repeated blocks that ``compile_regions=True`` compiles one by one (and that
        ``SingleDeviceStrategy(activation_checkpointing=True)`` checkpoints), e.g.
        ``list(self.layers)``. None (the default): the children of the module's largest
        ``nn.ModuleList`` whose children are all of one class (``lightlike.blocks.find_blocks``)."""
        return None

    def maybe_checkpoint(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args)`` under activation checkpointing when it is switched on (and while
        training, with gradients enabled); otherwise call it plainly."""
        if self._checkpointing_on and self.training and torch.is_grad_enabled():
            tally = _current_tally.get()
            if tally is not None:
                tally.calls += 1
            if torch.compiler.is_compiling():  # dynamo takes no context_fn of this kind; a compiled
                return checkpoint(fn, *args, use_reentrant=False, **kwargs)  # graph updates buffers once anyway
            owner = fn if isinstance(fn, nn.Module) else self  # running statistics updated once, not twice
            return checkpoint(fn, *args, use_reentrant=False, context_fn=buffers_kept_on_recompute(owner), **kwargs)
        return fn(*args, **kwargs)

    def save_hyperparameters(self, **extra: Any) -> None:
        """Record the caller's ``__init__`` arguments in ``self.hparams`` (written beside the
        weights as ``hparams.json``, used to rebuild the module)."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is not None:
            args = inspect.getargvalues(caller)
            for name in args.args:
                if name != "self":
                    self.hparams[name] = args.locals[name]
            if args.keywords:
                self.hparams.update(args.locals[args.keywords])
        self.hparams.update(extra)

    def load_weights(self, path: str | Path, strict: bool = True, verify_hashes: bool = True) -> None:
        """Load weights from a ``model.safetensors`` file (or a folder holding one), such as
        ``lightlike export`` writes, or from a checkpoint directory. A checkpoint (a folder with a
        ``manifest.json``, or a file inside one) is verified first, as a resume verifies it: sizes,
        and checksums unless ``verify_hashes=False``."""
        from safetensors.torch import load_file

        from lightlike.checkpoint.files import WEIGHTS_FILE
        from lightlike.checkpoint.manifest import MANIFEST, verify_checkpoint

        p = Path(path)
        if p.is_dir() and not (p / WEIGHTS_FILE).is_file() and (p / MANIFEST).is_file():
            raise CheckpointError(f"{p} is a sharded checkpoint: consolidate it first with "
                                  f"`lightlike export {p} OUT_DIR`, then load OUT_DIR")
        if p.is_dir():
            p = p / WEIGHTS_FILE
        if (p.parent / MANIFEST).is_file():
            manifest = verify_checkpoint(p.parent, hashes=verify_hashes)
            if p.name not in manifest["files"]:
                raise CheckpointError(f"{p.parent}: {p.name} is not listed in its {MANIFEST}")
            from lightlike.checkpoint.frozen import check_base

            check_base(self, p.parent)  # an adapter's checkpoint: trained on this module's base?
        state = load_file(str(p))
        from lightlike.checkpoint.weights import load_module_state

        load_module_state(self, state, strict=strict, source=str(p))


class CheckpointTally:
    """Counts ``maybe_checkpoint`` calls that checkpoint while it is current (``start()`` to
    ``stop()``, in this thread): how the Fitter's check learns that ``gradient_checkpointing=True``
    does something, without writing onto the module."""

    def __init__(self) -> None:
        self.calls = 0

    def start(self) -> None:
        _current_tally.set(self)

    def stop(self) -> None:
        if _current_tally.get() is self:
            _current_tally.set(None)


_current_tally: contextvars.ContextVar[CheckpointTally | None] = contextvars.ContextVar("lightlike_checkpoint_tally",
                                                                                       default=None)


def batch_length(batch: Any) -> int:
    """The batch's number of items, read from its first field (in order, through mappings and
    the batch's own list or tuple of fields): a tensor's first dimension, or a list's length
    (one entry per item: strings, variable-length sequences). A list whose entries are tensors
    of one first dimension that another field's tensor has too (and not the list's length) is
    torch's default collate of a list in each item (one tensor per position): that dimension.
    A batch that is a list of the items themselves (mappings with the same keys, or tuples: a
    collate_fn that keeps them) counts them. Override ``num_items`` where this is not the count (a batch
    that is a list of variable-length tensors, say: read as fields, it counts the first one's
    length, as Lightning's batch-size guess does)."""
    if type(batch) is dict and batch:  # the usual batches, answered without ABC checks
        first = next(iter(batch.values()))
        if type(first) is torch.Tensor and (shape := first.shape):  # (one read of the tensor's shape)
            return shape[0]
    elif type(batch) in (list, tuple) and len(batch) >= 2:  # (inputs, targets)
        a, b = batch[0], batch[1]
        if type(a) is torch.Tensor and type(b) is torch.Tensor and a.ndim and b.ndim and a.shape[0] == b.shape[0]:
            return a.shape[0]
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    n = _count(batch, _field_rows(batch, top=True), top=True)
    if n is None:
        raise TypeError(
            f"cannot tell how many items a batch of type {type(batch).__name__} holds; "
            "override TaskModule.num_items(batch)"
        )
    return n


def _fields(v: Any, top: bool) -> Any:
    """The fields of a mapping, or of the batch's own list or tuple; None for anything else."""
    if isinstance(v, Mapping):
        return v.values()
    if top and isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        return v
    return None


def _field_rows(v: Any, top: bool = False) -> set[int]:
    """First dimensions of the tensors that are fields (not entries of a list field)."""
    if isinstance(v, torch.Tensor):
        return {int(v.shape[0])} if v.ndim else set()
    fields = _fields(v, top)
    return set().union(*(_field_rows(x) for x in fields)) if fields is not None else set()


def _count(v: Any, rows: set[int], top: bool = False) -> int | None:
    if isinstance(v, torch.Tensor):
        return int(v.shape[0]) if v.ndim else None
    if top and isinstance(v, (list, tuple)) and v and _one_per_item(v):  # a list of the items themselves
        return len(v)
    fields = _fields(v, top)
    if fields is not None:
        for x in fields:
            n = _count(x, rows)
            if n is not None:
                return n
        return None
    if isinstance(v, (list, tuple)):  # a list field
        dims = {int(x.shape[0]) if isinstance(x, torch.Tensor) and x.ndim else -1 for x in v}
        if len(dims) == 1 and (d := dims.pop()) > 0 and d in rows and len(v) not in rows:
            return d
        return len(v)
    return None


def _one_per_item(v: list | tuple) -> bool:
    """A batch that is a list of the items themselves (a collate_fn that keeps them): mappings
    that all have the same keys, or tuples of one length (torch's default collate makes lists,
    never tuples). A list of tensors cannot be told from a tuple of fields."""
    if len(v) < 2:
        return False
    if all(isinstance(x, Mapping) for x in v):
        return len({frozenset(x) for x in v}) == 1
    return all(isinstance(x, tuple) for x in v) and len({len(x) for x in v}) == 1


def check_task_module(module: Any) -> None:
    if not isinstance(module, TaskModule):
        raise ModuleContractError(
            f"fit/validate/test/predict take a lightlike.TaskModule, got {type(module).__name__}; "
            "subclass ll.TaskModule and define forward(batch) and loss(outputs, batch)"
        )

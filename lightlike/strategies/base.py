"""The ``Strategy`` contract: what the loop asks about devices and processes.

A strategy sets up the processes and the device, wraps the module and the optimizer, runs
backward and the optimizer step (through its ``Precision`` plugin), clips gradients on the true
global norm, and opens the no-sync context of accumulation. Those members are abstract or have
one-line defaults here: each strategy says how it does each (``SingleDeviceStrategy`` for one
process; ``DDPStrategy``, ``FSDPStrategy`` and ``DeepSpeedStrategy`` on the ``ParallelStrategy``
base). Two objects of their own hang off it, so the loop never asks which strategy it has: what
all ranks compute together (reduce, gather, broadcast, barrier, agreeing on flags),
``strategy.collectives``; and how a checkpoint holds the weights and optimizer state,
``strategy.checkpoint_layout`` (``lightlike/strategies/layouts.py``: full, DCP, DeepSpeed).

The functions at the end (``clip_gradients``, ``global_norm``, ``move_to_device``) are the plain
ways that several strategies share.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from lightlike.precision import Precision
from lightlike.strategies.collectives import Collectives
from lightlike.strategies.layouts import CheckpointLayout, FullLayout
from lightlike.utils.batches import map_tensors

#: the host (compared with ``root_device``: a device's ``.type`` builds a string on every read)
CPU = torch.device("cpu")


class Strategy(ABC):
    """The contract. Subclasses implement the abstract members and override the defaults that
    differ for them."""

    name: str = "base"
    #: True once ``setup_module`` checkpoints the module's blocks itself (FSDP's shard units with
    #: ``activation_checkpointing``): the Fitter's check that ``gradient_checkpointing`` acts reads it
    checkpoints_activations: bool = False
    #: whether the backward pass leaves the gradients in the parameters' ``.grad`` (not ZeRO's
    #: buffers): the step's check that the loss reaches the parameters (``StepContext``) reads it
    gradients_on_parameters: bool = True
    #: the gradients are plain tensors on one device (single, DDP): the global norm takes torch's
    #: arithmetic without regrouping them by device (``global_norm``)
    _plain_gradients: bool = False

    def __init__(self, accelerator: str = "auto", precision: Precision | None = None) -> None:
        self._accelerator = accelerator  # the device kind asked for: read by the strategy alone
        self.precision: Precision = precision if precision is not None else Precision()
        self.root_device = CPU
        #: what the ranks compute together (identity on one process)
        self.collectives: Collectives = Collectives()
        #: how a checkpoint holds the weights and optimizer state (``layouts.py``; "full" here)
        self.checkpoint_layout: CheckpointLayout = FullLayout(self)

    # -- processes and devices (one process unless overridden) --------------------------------
    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @abstractmethod
    def setup_environment(self) -> None:
        """Start the process group (if any), bind the device and set up the precision plugin
        (``self.precision.setup(self.root_device)``)."""

    def configure(self, config: Any) -> None:
        """Receive the run's ``FitConfig`` before anything is set up, for strategies that must
        generate settings from it (DeepSpeed's config: batch sizes, accumulation, clipping)."""
        return None  # (none here)

    def teardown(self) -> None:
        """Release the process group and anything else set up."""
        return None  # (none here)

    # -- module and optimizer ------------------------------------------------------------------
    @abstractmethod
    def setup_module(self, module: nn.Module, manual: bool = False) -> nn.Module:
        """Move, convert and wrap the module. Returns the module the loop calls. ``manual``: the
        module optimizes itself (``training_step``: manual optimization, ``lightlike/manual.py``),
        and the loop averages its gradients over the ranks at each ``ctx.step``
        (``prepare_gradients``); a strategy that cannot run one raises ``ConfigError`` here."""

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the optimizer built over ``setup_module``'s parameters. Returns the module the
        loop calls and the optimizer it steps: an engine that owns both (DeepSpeed) may replace
        the module here too."""
        return model, optimizer  # (the optimizer steps the parameters as they are)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Where ``Fitter.init_module()`` builds the module: as usual, unless a sharded strategy
        can build it without materialising it whole on one device."""
        return contextlib.nullcontext()

    def setup_module_for_evaluation(self, module: nn.Module) -> nn.Module:
        """``setup_module`` for ``validate``/``test``/``predict`` without a ``fit`` before them
        (no optimizer: a strategy that needs one to run the module says so here)."""
        return self.setup_module(module)

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[nn.Module]:
        """Around one evaluation pass (no gradients): yields what to call. A strategy whose ranks
        hold their own copies of the buffers (BatchNorm statistics) gives every rank rank 0's
        first, the ones a checkpoint saves, so that all ranks evaluate the same model."""
        yield model

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's TaskModule inside whatever wrapper ``setup_module`` added, and inside
        ``torch.compile``'s (``compile=True``), whose ``_orig_mod.`` prefix must not reach the
        checkpoint's weight names."""
        return getattr(module, "_orig_mod", module)  # type: ignore[no-any-return]

    def batch_to_device(self, batch: Any) -> Any:
        """The batch on this process's device, cast as the precision wants its inputs."""
        if self.root_device != CPU:  # CPU batches are already where they need to be
            batch = move_to_device(batch, self.root_device)
        return self.precision.convert_input(batch)

    @property
    def forward_is_collective(self) -> bool:
        """Whether a forward pass takes part in collectives (sharded parameters gathered on the
        fly: FSDP, ZeRO-3), so that every rank must run the same number of them: evaluation
        then keeps the ranks in step when their shares hold different numbers of batches."""
        return False

    # -- a training step -----------------------------------------------------------------------
    @abstractmethod
    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step: with ``enabled``, its gradients must not be synchronised
        over ranks yet (a micro-step before the last of an accumulation window)."""

    def backward(self, loss: torch.Tensor, module: nn.Module, retain_graph: bool = False) -> None:
        """Backward of ``loss`` (already weighted by the loop; scaled by the precision if it must);
        ``retain_graph`` keeps the graph for another backward through it."""
        self.precision.backward(loss, retain_graph)

    def prepare_gradients(self, optimizer: torch.optim.Optimizer, where: tuple[int, int] = (0, 0)) -> None:
        """Make ``optimizer``'s gradients the true, synchronised ones, once per step before
        clipping or stepping: unscaled (``16-mixed``), and averaged over the ranks where backward
        did not average them (manual optimization under DDP). ``where``: (the training step, the
        optimizer's index in ``ctx.optimizers``), for an error that names them."""
        self.precision.unscale_gradients(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, module: nn.Module, max_norm: float | None,
             max_value: float | None, vet: Callable[[torch.optim.Optimizer, torch.Tensor | None], bool]) -> StepResult:
        """The whole optimizer step over gradients ``prepare_gradients`` made ready: clip (by value,
        then by the global norm), ask ``vet(optimizer, norm)`` whether to update (``norm``: the
        global norm before clipping, or None where the update skips a non-finite one itself: a
        loss scaler's overflow), then update through the precision. False from ``vet`` vetoes
        the update. Reports what happened (``StepResult``)."""
        norm = clip_gradients(optimizer, max_norm, max_value, True, self._plain_gradients)  # (want_norm, one_device)
        precision = self.precision
        if not vet(optimizer, None if precision.uses_scaler else norm):
            precision.abandon_step(optimizer)
            return StepResult(False, None, False)
        applied = precision.step(optimizer)
        return StepResult(applied, norm, not applied)

    def item_normaliser(self, counts: list[int | torch.Tensor], uniform: bool = False) -> StepNormaliser:
        """The denominator of exact accumulation (``.total``).

        Micro-batch i's loss is weighted by ``n_i / total``, so that after this strategy's
        gradient reduction the step's gradient is that of the mean loss over every item of the
        step (all micro-batches, all ranks). On one process: the sum of the counts (ints stay
        ints; tensors stay on the device, so no host read). A distributed strategy may start its
        reduction here and finish it when ``total`` is first read, so it overlaps the first
        forward pass. ``uniform=True`` promises that every rank holds the same integer counts this
        step (lightlike's sampler deals equal shares), which lets a distributed strategy skip the
        reduction."""
        return StepNormaliser(sum(counts[1:], counts[0]))  # (counts[0] + counts[1] + ...)

    def discard_gradients(self, module: nn.Module) -> None:
        """Drop every gradient the module holds, also those of an accumulation window an error
        cut short (``auto_find_batch_size`` retries on the same module)."""
        self.unwrap(module).zero_grad(set_to_none=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, precision={self.precision.name!r})"


class StepResult(NamedTuple):
    """What ``Strategy.step`` did: whether the update was ``applied``; the global gradient norm
    before clipping (a device tensor, not read; None when the update was vetoed); whether a loss
    scaler skipped the update (``overflow``: its normal handling of a non-finite gradient). Not
    applied, not vetoed and no overflow: the update itself refused a non-finite gradient
    (DeepSpeed's engine)."""

    applied: bool
    grad_norm: torch.Tensor | None
    overflow: bool


class StepNormaliser:
    """This step's item normaliser ``total`` (see ``Strategy.item_normaliser``): a plain attribute,
    read by the loop without a call. A strategy that reduces it asynchronously returns a subclass
    whose ``total`` waits for the reduction (``ParallelStrategy``)."""

    __slots__ = ("total",)

    def __init__(self, total: int | torch.Tensor):
        self.total = total


# -- the plain ways, shared by the strategies that take them ----------------------------------------
def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float | None, max_value: float | None,
                   want_norm: bool = False, one_device: bool = False) -> torch.Tensor | None:
    """Clipping over the optimizer's (unscaled) gradients with torch's utilities: clip by value,
    then by the global norm; returns the norm before clipping (``want_norm``: also without
    clipping). A gradient sharded as a DTensor (FSDP) gives the norm of its shard; the partial norms are reduced over the mesh (a per-shard norm would be
    wrong), so the norm is the true global one on every strategy. With ``max_value``, an inf
    gradient, which clipping by value turns into ``max_value``, is seen in the norm before it is
    clipped: the norm returned is that one when it is not finite (NaN/inf is never clipped out of sight).
    ``one_device``: the strategy put every parameter on its one device (single, DDP), so the norm
    takes torch's arithmetic without regrouping the gradients by device (see ``global_norm``)."""
    if max_norm is None and max_value is None:  # no clipping: the norm at most (the usual step)
        if not want_norm:
            return None
        return global_norm([g for group in optimizer.param_groups for p in group["params"]
                            if (g := p.grad) is not None], one_device)  # (each .grad read once: a tensor's getter costs)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grads = [p.grad for p in params]  # (torch's clipping takes the parameters)
    unclipped = None
    if max_value is not None:
        if max_norm is not None or want_norm:
            unclipped = global_norm(grads, one_device)
        torch.nn.utils.clip_grad_value_(params, max_value, foreach=True)
    if max_norm is None and not want_norm:
        return None
    norm = global_norm(grads, one_device)
    if unclipped is not None:
        norm = torch.where(torch.isfinite(unclipped), norm, unclipped)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def global_norm(grads: list[torch.Tensor], one_device: bool = False) -> torch.Tensor:
    """The 2-norm of ``grads`` (the parameters' gradients) over every rank (a device tensor).

    Plain tensors on one device (``one_device``: every step of a usual fit computes this norm,
    for the non-finite check): one ``_foreach_norm`` and the norm of the norms, the arithmetic
    of torch's ``get_total_norm`` without its grouping by device and dtype. Others (FSDP's
    DTensor shards, tensor subclasses) go through ``get_total_norm``."""
    if one_device and grads and type(grads[0]) is torch.Tensor:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)  # type: ignore[misc]
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()  # the partial norms of the shards, reduced over the mesh
    return norm


def move_to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``, non-blocking from pinned memory; an
    object of another kind that has a ``to`` method (a batch class of the user's) moves itself
    with ``obj.to(device)``, as Lightning moves it."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True) if t.device != device else t,
                       lambda other: _moved_by_its_to(other, device))


def _moved_by_its_to(obj: Any, device: torch.device) -> Any:
    to = getattr(obj, "to", None)
    if not callable(to) or isinstance(obj, type):
        return obj
    moved = to(device)
    return obj if moved is None else moved  # a to() that moves the object in place

"""The ``Strategy`` contract: everything the loop asks about devices and processes.

One process group and device setup, wrapping of module and optimizer, backward and optimizer
step (delegated to the ``Precision`` plugin), gradient clipping on the true global norm,
collectives (reduce, gather, barrier, broadcast), the no-sync context for accumulation, and the
state that goes into checkpoints. ``SingleDevice`` implements it for one process; DDP, FSDP and
DeepSpeed implement the same methods, so ``Fitter`` never asks which strategy it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightlike.precision import Precision
from lightlike.precision.base import NO_CONTEXT
from lightlike.utils.batches import map_tensors


class Strategy:
    """Base class. Subclasses set up devices and processes and override what differs."""

    name: str = "base"

    def __init__(self, accelerator: str = "auto", precision: Precision | None = None) -> None:
        self.accelerator = accelerator
        self.precision: Precision = precision if precision is not None else Precision()
        self.root_device = torch.device("cpu")

    # -- processes and devices -----------------------------------------------------------------
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

    def configure(self, config: Any) -> None:
        """Receive the run's ``FitConfig`` before anything is set up, for strategies that must
        generate settings from it (DeepSpeed's config: batch sizes, accumulation, clipping)."""

    def setup_environment(self) -> None:
        """Start the process group (if any), bind the device and set up the precision plugin."""
        self.precision.setup(self.root_device)

    def teardown(self) -> None:
        """Release the process group and anything else set up."""

    def note_failure(self, report: str | None = None, call: int = 0) -> None:
        """The loop is unwinding after an error of this rank's: teardown must not wait for the
        other ranks. ``report`` (this rank's one-line account of call number ``call``) is left
        where the peers can read it (``failed_peers``)."""

    def failed_peers(self, call: int = 0) -> list[str]:
        """The reports other ranks left with ``note_failure`` for call number ``call``, in rank
        order (none that cannot be read)."""
        return []

    # -- module and optimizer ------------------------------------------------------------------
    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Where ``Fitter.init_module()`` builds the module: as usual, unless a sharded strategy
        can build it without materialising it whole on one device."""
        return contextlib.nullcontext()

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move, convert and wrap the module. Returns the module the loop calls."""
        module = self.precision.convert_module(module)
        return module.to(self.root_device)

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the optimizer built over ``setup_module``'s parameters. Returns the module the
        loop calls and the optimizer it steps: an engine that owns both (DeepSpeed) may replace
        the module here too."""
        return model, optimizer

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
        if self.root_device.type != "cpu":  # CPU batches are already where they need to be
            batch = move_to_device(batch, self.root_device)
        return self.precision.convert_input(batch)

    def moves_batches(self) -> bool:
        """Whether ``batch_to_device`` can change a batch: False on the CPU with the precision
        casting no input (and neither method overridden), where the loop then skips the call."""
        precision = self.precision
        return (type(self).batch_to_device is not Strategy.batch_to_device or self.root_device.type != "cpu"
                or precision.param_dtype is not None or type(precision).convert_input is not Precision.convert_input)

    # -- a training step -----------------------------------------------------------------------
    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for micro-steps whose gradients must not be synchronised yet."""
        return NO_CONTEXT

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, module: nn.Module) -> None:
        self.precision.backward(loss)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        max_value: float | None,
        want_norm: bool = False,
    ) -> torch.Tensor | None:
        """Unscale, clip by value and/or by global norm. Returns the global norm of the
        gradients before norm clipping (a device tensor, not read here) when clipping by norm or
        when ``want_norm``; otherwise None, so steps that do not log skip the norm."""
        self.precision.unscale_gradients(optimizer)
        if max_norm is None and max_value is None and not want_norm:
            return None  # nothing to do: no per-parameter work on this step
        params = [p for p in _params(optimizer) if p.grad is not None]
        if max_value is not None:
            torch.nn.utils.clip_grad_value_(params, max_value, foreach=True)
        if max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if want_norm:
            return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)  # type: ignore[misc]
        return None

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
        """Step; False when the update was skipped (fp16 overflow)."""
        return self.precision.optimizer_step(optimizer)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.zero_grad(set_to_none=True)``. For an optimizer that keeps torch's own
        ``zero_grad``, that is exactly ``p.grad = None`` for every parameter of every group,
        done here directly: torch's version also opens a profiler range and builds a foreach
        table, 7.8 us against 0.3 us on a four-tensor model (benchmarks/RESULTS.md)."""
        if type(optimizer).zero_grad is not _TORCH_ZERO_GRAD:  # its own zero_grad: call it
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    # -- collectives (identity on one process) ---------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def item_normaliser(self, counts: list[int | torch.Tensor], flag: bool = False,
                        uniform: bool = False) -> StepNormaliser:
        """The denominator of exact accumulation, and whether ``flag`` is set on any rank.

        Micro-batch i's loss is weighted by ``n_i / total``, so that after this strategy's
        gradient reduction the step's gradient is that of the mean loss over every item of the
        step (all micro-batches, all ranks). On one process: the sum of the counts (ints stay
        ints; tensors stay on the device, so no host read). ``flag`` (a stop request such as
        preemption) rides along, so agreeing on it costs no extra collective. A distributed
        strategy may start its reduction here and finish it when ``total`` is first read,
        so it overlaps the first forward pass. ``uniform=True`` promises that every rank holds the
        same integer counts this step (lightlike's sampler deals equal shares), which lets a
        distributed strategy skip the reduction; the flag is then returned as None (not agreed)."""
        return StepNormaliser(sum(counts[1:], counts[0]), flag)  # (counts[0] + counts[1] + ...)

    @property
    def forward_is_collective(self) -> bool:
        """Whether a forward pass takes part in collectives (sharded parameters gathered on the
        fly: FSDP, ZeRO-3), so that every rank must run the same number of them: evaluation
        then keeps the ranks in step when their shares hold different numbers of batches."""
        return False

    def sum_floats(self, values: list[float]) -> list[float]:
        """Sum host-side numbers over ranks (identity on one process)."""
        return values

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_in_order(self, local: Any, dealt: bool = True) -> Any:
        """Evaluation outputs of every rank, in dataset order (identity on one process): dealt
        round-robin, as lightlike splits a set; ``dealt=False`` (a dataset that shards itself)
        rank 0's items first, then rank 1's, and so on."""
        return local

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self, name: str = "") -> None:
        pass

    def reduce_flag(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank (control decisions agree)."""
        return flag

    def reduce_flag_async(self, flag: bool) -> Callable[[], bool]:
        """Start agreeing on ``flag`` as ``reduce_flag`` does; the returned function, called later
        at the same point on every rank, gives the agreed value. For checks that can wait a few
        steps (preemption), so that agreeing costs the step no wait and no device sync."""
        value = self.reduce_flag(flag)
        return lambda: value

    # -- checkpoint state --------------------------------------------------------------------------
    #: how ``save_checkpoint_state`` lays out weights and optimizer state; recorded in the
    #: manifest's meta as ``state_format`` ("full": ``model.safetensors`` + ``optimizer.pt``)
    checkpoint_format: str = "full"
    #: the layouts a run resumes from under this strategy, optimizer state included (a checkpoint
    #: of another layout is refused before anything loads; its weights can start a new fit)
    resumes_from: tuple[str, ...] = ("full", "dcp")

    def save_checkpoint_state(self, writer: Any, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        """Write the weights, and the optimizer state unless ``optimizer`` is None, into the
        checkpoint that ``writer`` (a ``CheckpointWriter`` whose temp directory every rank shares)
        is assembling. Called on every rank, so it may be collective; files go to
        ``writer.path_for(rel)``. This default gathers the full state and lets the main rank write
        ``model.safetensors`` and ``optimizer.pt``; sharded strategies write each rank's shards.
        Returns None when the files are written, or a future (``.result()``) for a write still
        going on in the background, which the checkpoint layer waits on before committing."""
        weights = self.module_state_dict(module)
        optim_state = self.optimizer_state_dict(optimizer) if optimizer is not None else None
        if self.is_global_zero:
            writer.save_safetensors("model.safetensors", weights)
            if optim_state is not None:
                writer.save_torch("optimizer.pt", optim_state)

    def load_checkpoint_state(self, path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Restore what ``save_checkpoint_state`` wrote into a verified checkpoint at ``path``
        (weights only when ``optimizer`` is None). Called on every rank. A sharded DCP
        checkpoint (written by FSDP) loads too: its names do not depend on the sharding."""
        from lightlike.checkpoint.weights import load_safetensors

        if (path / "dcp").is_dir():
            from lightlike.checkpoint.dcp import load_dcp_state

            load_dcp_state(path / "dcp", self.unwrap(module), optimizer)
            return

        self.load_module_state_dict(module, load_safetensors(path / "model.safetensors"))
        if optimizer is not None:
            state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
            try:
                self.load_optimizer_state_dict(optimizer, state)
            except ValueError as e:  # (after the optimizer's own load hooks, which may adapt the state)
                if "parameter group" not in str(e):
                    raise
                raise group_size_error(optimizer, state, path) from e

    def discard_gradients(self, module: nn.Module) -> None:
        """Drop every gradient the module holds, also those of an accumulation window an error
        cut short (``auto_find_batch_size`` retries on the same module)."""
        self.unwrap(module).zero_grad(set_to_none=True)

    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights of the user's module (on CPU), for ``model.safetensors``."""
        return {k: v.detach() for k, v in self.unwrap(module).state_dict().items()}

    def load_module_state_dict(
        self, module: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True
    ) -> None:
        from lightlike.checkpoint.weights import load_module_state

        load_module_state(self.unwrap(module), state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        optimizer.load_state_dict(state)  # type: ignore[arg-type]

    def memory_footprint(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that *this rank* holds (its local
        shards under sharded strategies), for memory comparisons between strategies."""
        params = list(self.unwrap(module).parameters())
        opt_tensors = [] if optimizer is None else [
            t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return {"params": _nbytes(params), "grads": _nbytes([p.grad for p in params if p.grad is not None]),
                "optimizer": _nbytes(opt_tensors)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, precision={self.precision.name!r})"


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


class StepNormaliser:
    """This step's item normaliser ``total`` and agreed stop ``flag`` (see ``Strategy.item_normaliser``):
    plain attributes, read by the loop without a call. A strategy that reduces them asynchronously
    returns a subclass whose attributes wait for the reduction (``DDPStrategy``)."""

    __slots__ = ("total", "flag")

    def __init__(self, total: int | torch.Tensor, flag: Any):
        self.total, self.flag = total, flag


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held locally: a DTensor (FSDP2 shard) counts its local shard only."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


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


def group_size_error(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], path: Path) -> Exception:
    """torch's refusal of an optimizer state whose parameter groups hold other numbers of
    parameters than the optimizer's, as an error that says which and why."""
    from lightlike.errors import CheckpointError

    saved = [len(g.get("params", ())) for g in state.get("param_groups", ())]
    now = [len(g["params"]) for g in optimizer.param_groups]
    return CheckpointError(
        f"{path.name}: its optimizer state holds parameter groups of {saved} parameters, this run's optimizer "
        f"{now}: the trainable parameters changed (frozen, added) or so did their grouping (lightlike's built-in "
        "optimizer keeps every parameter whose name contains 'bias' out of weight decay, as the HF Trainer; "
        "before 2026-11-24 it decayed 2-D ones such as T5's relative_attention_bias). Start a new fit from its "
        f"weights (module.load_weights('{path}') before fit, without resume)")

"""``compile=True``: each micro-batch's computation compiled as one function.

Training takes ``module.loss(model(batch), batch)`` for every micro-batch. With ``compile=True``
that whole expression is one ``torch.compile``d function, so the module's loss (an fp32 upcast of
large logits and a cross-entropy, say) is traced, fused and memory-planned together with the
forward, instead of running eagerly after a compiled forward. Evaluation compiles forward, loss
and metrics the same way, as a second function: one graph per mode, and switching between
training and evaluation recompiles nothing. The module is not wrapped: its weights, parameter
names and ``state_dict`` stay its own (no ``_orig_mod.``).

``compile_regions=True`` compiles each repeated block in place (``nn.Module.compile``, after the
strategy set the module up, so after FSDP's ``fully_shard``) and the loss (with the metrics, in
evaluation) as functions of their own; the rest runs eagerly. Blocks of one class share one
compiled graph, so a deep model compiles in about the time of one block.

What the loop checks of the loss (a scalar that requires grad: ``check_loss``) and the errors
that name a batch key the forward or the loss read and the batch lacks happen outside the
compiled function, on what it returns or raises. ``compile_seconds`` is the wall time of the
first call of each compiled function, backward graph included (it is lowered at once there).

The strategies' per-block activation checkpointing (``activation_checkpointing=True``) works
here: under ``compile=True`` they checkpoint each block in the form torch.compile traces (torch's
``checkpoint_wrapper``: ``lightlike.blocks.checkpoint_blocks``), so the compiled backward
recomputes the blocks' activations, in the whole step and in each compiled block alike.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightlike.blocks import find_blocks
from lightlike.evaluation import call_hook, call_loss, check_loss, error_naming_the_batch

log = logging.getLogger("lightlike")


def compile_run(run: Any, module: Any, config: Any) -> None:
    """With ``compile=True``, set ``run.compiled`` to a ``CompiledStep`` over ``module`` and
    ``run.forward_loss`` to its ``forward_loss``; without it, leave the run as it is (the eager
    ``forward_loss``, no extra cost per step)."""
    if not config.compile:
        return
    options = {"mode": config.compile_mode, "fullgraph": config.compile_fullgraph, "dynamic": config.compile_dynamic}
    run.compiled = CompiledStep(module, options, regions=config.compile_regions)
    run.forward_loss = run.compiled.forward_loss


class CompiledStep:
    """The compiled training step (``forward_loss``, the contract of ``evaluation.forward_loss``)
    and evaluation step (``evaluate``) of one fit. ``options`` go to ``torch.compile`` (and to
    each block's ``compile`` with ``regions``). ``compile_seconds``: the first calls' wall time,
    None before the first."""

    def __init__(self, module: nn.Module, options: dict[str, Any], regions: bool = False):
        self.module = module
        self.regions = regions
        self.compile_seconds: float | None = None
        self._train_timed = self._eval_timed = False  # the first call of each is timed
        if regions:
            blocks = find_blocks(module)
            for block in blocks:
                block.compile(**options)  # in place: names and state_dict keys stay the module's own
            log.info("compile_regions: %d blocks of %s compiled", len(blocks), sorted({type(b).__name__ for b in blocks}))
            loss = _compiled(_loss_fn(module), options)
            self._train = _train_fn(loss)
            self._eval = _eval_fn(_compiled(_loss_metrics_fn(module), options))
        else:
            self._train = _compiled(_train_fn(module.loss), options)
            self._eval = _compiled(_eval_fn(_loss_metrics_fn(module)), options)

    def forward_loss(self, model: Any, module: Any, batch: Any, where: str, *where_args: Any) -> torch.Tensor:
        """``module.loss(model(batch), batch)`` for a training micro-batch, compiled, with
        ``evaluation.forward_loss``'s checks and errors."""
        try:
            forward_none, loss = (self._train(model, batch) if self._train_timed
                                  else self._first("training step", self._train, model, batch))
        except Exception as e:
            if (error := self._named_error(e, batch, where, where_args)) is None:
                raise
            raise error from e
        if forward_none:  # taken eagerly: a loss() that cannot take None says forward() returned None
            return call_loss(module, None, batch, where, *where_args)
        if type(loss) is torch.Tensor and loss.ndim == 0 and loss.requires_grad:  # the usual loss
            return loss
        return check_loss(loss, where, *where_args)

    def evaluate(self, model: Any, batch: Any, with_loss: bool, where: str) -> tuple[Any, Any, Any]:
        """``(outputs, loss, metrics)`` of one evaluation batch (no gradients): ``metrics`` as
        ``module.metrics`` returned them; loss and metrics None without ``with_loss``."""
        try:
            outputs, loss, metrics = (self._eval(model, batch, with_loss) if self._eval_timed
                                      else self._first("evaluation step", self._eval, model, batch, with_loss))
        except Exception as e:
            if (error := self._named_error(e, batch, where, ())) is None:
                raise
            raise error from e
        if not with_loss:
            return outputs, None, None
        if outputs is None and loss is None:  # forward returned None: the loss taken eagerly, as above
            loss = call_loss(self.module, None, batch, where)
            metrics = call_hook(self.module.metrics, "metrics", batch, where, None, batch)
        return outputs, check_loss(loss, where), metrics

    def _first(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """The first call of ``fn`` (where it compiles), timed and logged."""
        start = time.perf_counter()
        with _backward_lowered_at_once():
            out = fn(*args)
        seconds = time.perf_counter() - start
        if fn is self._train:
            self._train_timed = True
        else:
            self._eval_timed = True
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        log.info("compile: the %s compiled and ran once in %.1f s", what, seconds)
        return out

    def _named_error(self, e: Exception, batch: Any, where: str, where_args: tuple) -> Exception | None:
        """The error naming what the batch lacks, for an error the compiled function raised (torch
        runs a frame whose tracing raised eagerly, so the traceback reaches the user's line), or
        None where it is not about the batch."""
        return error_naming_the_batch(e, batch, _raised_in(e, self.module), where, *where_args)


# -- the functions compiled -------------------------------------------------------------------------
def _train_fn(loss: Callable[[Any, Any], Any]) -> Callable[[Any, Any], tuple[bool, Any]]:
    def training_step(model: Any, batch: Any) -> tuple[bool, Any]:
        outputs = model(batch)
        if outputs is None:  # (decided while tracing) the loss is taken outside, eagerly
            return True, None
        return False, loss(outputs, batch)
    return training_step


def _loss_fn(module: Any) -> Callable[[Any, Any], Any]:
    def loss(outputs: Any, batch: Any) -> Any:
        return module.loss(outputs, batch)
    return loss


def _loss_metrics_fn(module: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    def loss_and_metrics(outputs: Any, batch: Any) -> tuple[Any, Any]:
        return module.loss(outputs, batch), module.metrics(outputs, batch)
    return loss_and_metrics


def _eval_fn(loss_and_metrics: Callable[[Any, Any], tuple[Any, Any]]) -> Callable[..., tuple[Any, Any, Any]]:
    def evaluation_step(model: Any, batch: Any, with_loss: bool) -> tuple[Any, Any, Any]:
        outputs = model(batch)
        if not with_loss or outputs is None:
            return outputs, None, None
        loss, metrics = loss_and_metrics(outputs, batch)
        return outputs, loss, metrics
    return evaluation_step


def _compiled(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` on a copy of ``fn`` with a code object of its own: torch keeps its
    compiled graphs per code object, so each fit gets a cache of its own, freed with it (a
    process that fits many modules does not reach torch's recompile limit, past which it would
    run them eagerly, and no fit runs a graph guarded for another's module)."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, **options)


@contextlib.contextmanager
def _backward_lowered_at_once() -> Iterator[None]:
    """Around a first call: the backward graph is compiled with the forward rather than at the
    first backward, so that the first call's time is the whole compile time. (A setting of
    torch's functorch; without it, as torch does by default.)"""
    try:
        from torch._functorch import config as functorch_config
    except ImportError:  # pragma: no cover - other torch versions
        yield
        return
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


def _raised_in(e: BaseException, module: Any) -> str:
    """Which of the module's methods ``e`` came from, as the errors name it: "loss()",
    "metrics()" (the innermost of them on the traceback) or "the module" (its forward)."""
    codes = {}
    for name in ("loss", "metrics"):
        code = getattr(getattr(type(module), name, None), "__code__", None)
        if code is not None:
            codes[code] = f"{name}()"
    who = "the module"
    tb = e.__traceback__
    while tb is not None:
        who = codes.get(tb.tb_frame.f_code, who)
        tb = tb.tb_next
    return who

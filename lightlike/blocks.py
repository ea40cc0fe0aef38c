"""A module's repeated blocks (a transformer's layers): what ``compile_regions=True`` compiles
one by one, and what ``SingleDeviceStrategy(activation_checkpointing=True)`` checkpoints.

Found the way torchtitan names them, without a list of class names: the module's own
``compile_regions()`` where it returns modules, or else the children of its largest
``nn.ModuleList`` (by parameter count) whose children are two or more modules of one class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightlike.errors import ConfigError


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The module's repeated blocks: what its ``compile_regions()`` returns, or else the children of
    its largest ``nn.ModuleList`` (by parameter count) whose children are two or more of one
    class (a transformer's layers). Shared by ``compile_regions`` and the per-block activation
    checkpointing of ``SingleDeviceStrategy``; an error names the module where none is found."""
    hook = getattr(module, "compile_regions", None)
    named = hook() if callable(hook) else None
    if named is not None:
        blocks = list(named)
        bad = [type(b).__name__ for b in blocks if not isinstance(b, nn.Module)]
        if bad or not blocks:
            raise ConfigError(f"{type(module).__name__}.compile_regions() returned "
                              f"{'no module' if not blocks else f'non-modules ({bad})'}: return the block modules "
                              "to compile (or checkpoint) one by one, e.g. list(self.layers)")
        return blocks
    best: list[nn.Module] = []
    best_size = -1
    for m in module.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = list(m), size
    if not best:
        raise ConfigError(f"{type(module).__name__} has no repeated blocks to compile or checkpoint one by one (an "
                          "nn.ModuleList of two or more modules of one class): define compile_regions() returning "
                          "them, or use compile_regions=False (activation_checkpointing=False)",
                          settings=("compile_regions",))
    return best


def checkpoint_blocks(module: nn.Module, blocks: list[nn.Module], compiled: bool = False) -> list[nn.Module]:
    """Activation checkpointing of each block of ``module``, as FSDP checkpoints its shard units:
    a block's activations are recomputed in backward, and its running statistics (BatchNorm) are
    updated once per forward, not again by the recompute. Returns the blocks as the module now
    calls them.

    Without ``compiled``: torch's composable ``checkpoint`` (hooks, no wrapper module: parameter
    names stay the same). Its hooks run a generator that torch.compile does not trace (it breaks
    the graph there, and the recompute then meets another graph than the forward), so with
    ``compiled`` (``compile=True``) each block is replaced in its parent by torch's
    ``checkpoint_wrapper``, as torchtitan does: the wrapper's forward calls
    ``torch.utils.checkpoint.checkpoint``, which torch.compile traces into the graph, marking the
    block's activations to be recomputed in the compiled backward. ``state_dict`` keys stay the
    same (the wrapper removes its ``_checkpoint_wrapped_module.`` prefix there); the names that
    ``named_parameters()`` of the whole module gives carry it. A block checkpointed already (by
    an earlier fit of the same module) is left as it is."""
    from torch.distributed._composable.checkpoint_activation import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from lightlike.utils.buffers import buffers_kept_on_recompute

    done = [b for b in blocks if isinstance(b, CheckpointWrapper)]  # by an earlier compiled fit
    if not compiled:
        for block in blocks:
            if checkpoint.state(block) is None and block not in done:
                checkpoint(block, context_fn=buffers_kept_on_recompute(block))
        return blocks
    hooked = [type(b).__name__ for b in blocks if checkpoint.state(b) is not None]
    if hooked:
        raise ConfigError(f"compile=True with activation checkpointing, but the blocks ({hooked[0]}) were "
                          "checkpointed by hooks by an earlier fit of this module without compile, which "
                          "torch.compile cannot trace: build the module anew for the compiled fit",
                          settings=("compile",))
    parents = list(module.modules())
    return [block if block in done else _replace(parents, block, CheckpointWrapper(block, checkpoint_fn=_checkpointed))
            for block in blocks]


def _checkpointed(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The call of a checkpointed block (``checkpoint_wrapper``'s ``checkpoint_fn``): eagerly with
    the running statistics kept on recompute; while torch.compile traces, without (it takes no
    ``context_fn`` of this kind, and the compiled backward recomputes no buffer update). A Python
    side effect in the block's forward breaks the graph at this checkpoint; torch then runs it
    eagerly as traced, without the context, so running statistics in such a block are updated
    twice (documented in concepts.md, Compilation)."""
    from torch.utils.checkpoint import checkpoint

    from lightlike.utils.buffers import buffers_kept_on_recompute

    if torch.compiler.is_compiling():
        return checkpoint(block, *args, use_reentrant=False, **kwargs)
    return checkpoint(block, *args, use_reentrant=False, context_fn=buffers_kept_on_recompute(block), **kwargs)


def _replace(parents: list[nn.Module], block: nn.Module, wrapper: nn.Module) -> nn.Module:
    """``wrapper`` put where ``block`` was, in every parent that holds it; an error names a block
    no submodule holds (the module itself)."""
    found = False
    for parent in parents:
        for name, child in list(parent.named_children()):
            if child is block:
                setattr(parent, name, wrapper)
                found = True
    if not found:
        raise ConfigError(f"{type(block).__name__} is not a submodule of the module, so it cannot be replaced by "
                          "its checkpointed form under compile=True: return the module's own blocks from "
                          "compile_regions()", settings=("compile",))
    return wrapper

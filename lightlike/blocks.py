"""A module's repeated blocks (a transformer's layers): what ``compile_regions=True`` compiles
one by one, and what ``SingleDeviceStrategy(activation_checkpointing=True)`` checkpoints.

Found the way torchtitan names them, without a list of class names: the module's own
``compile_regions()`` where it returns modules, or else the children of its largest
``nn.ModuleList`` (by parameter count) whose children are two or more modules of one class.
"""

from __future__ import annotations

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


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Activation checkpointing of each block, with torch's composable ``checkpoint`` (hooks, no
    wrapper module: parameter names stay the same), as FSDP checkpoints its shard units: a
    block's activations are recomputed in backward, and its running statistics (BatchNorm) are
    updated once per forward, not again by the recompute. A block checkpointed already (by an
    earlier fit of the same module) is left as it is."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    from lightlike.utils.buffers import buffers_kept_on_recompute

    for block in blocks:
        if checkpoint.state(block) is None:
            checkpoint(block, context_fn=buffers_kept_on_recompute(block))

"""A model summary table: top-level children, parameter counts, size."""

from __future__ import annotations

from torch import nn


def _count(params: list[nn.Parameter]) -> tuple[int, int, int]:
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return total, trainable, nbytes


def _unique(params: list[nn.Parameter], seen: set[int]) -> list[nn.Parameter]:
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def model_summary(module: nn.Module) -> str:
    """Fixed-width table of the top-level children (tied parameters counted once)."""
    seen: set[int] = set()
    rows = []
    for name, child in module.named_children():
        total, trainable, _ = _count(_unique(list(child.parameters()), seen))
        rows.append((name, type(child).__name__, total, trainable))
    own = _unique(list(module.parameters(recurse=False)), seen)
    if own:
        t, tr, _ = _count(own)
        rows.append(("(own)", "Parameter", t, tr))
    total, trainable, nbytes = _count(_unique(list(module.parameters()), set()))
    w_name = max([4, *(len(r[0]) for r in rows)])
    w_type = max([4, *(len(r[1]) for r in rows)])
    lines = [f"{'name':<{w_name}}  {'type':<{w_type}}  {'params':>12}  {'trainable':>12}"]
    lines.append("-" * len(lines[0]))
    lines += [f"{n:<{w_name}}  {t:<{w_type}}  {p:>12,}  {tr:>12,}" for n, t, p, tr in rows]
    lines.append("-" * len(lines[0]))
    lines.append(f"total params: {total:,}  trainable: {trainable:,}  non-trainable: {total - trainable:,}  "
                 f"size: {nbytes / 2**20:.2f} MB")
    return "\n".join(lines)

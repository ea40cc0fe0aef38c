"""A model summary table: children to ``max_depth``, parameter counts, size."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

_OWN = "(own)"


def _numel(p: nn.Parameter) -> int:
    # a lazy module's parameters have no shape until the first forward; a ZeRO-3 partitioned one
    # is empty here and keeps its full size in ds_numel
    return 0 if isinstance(p, nn.parameter.UninitializedParameter) else int(getattr(p, "ds_numel", p.numel()))


def model_summary(module: nn.Module, max_depth: int = 1) -> str:
    """A fixed-width table of ``module``'s children down to ``max_depth`` levels (1: the
    top-level children) with their parameter counts, then the totals.

    A parameter shared by several modules (tied weights) is counted once, in the row of the
    first module that holds it (``named_parameters`` order), and once in the totals. The size
    is the parameters' bytes (element sizes of their dtypes), in MB (2**20 bytes).
    """
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    # each unique parameter under its first name; add its count to every ancestor prefix
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # prefix -> [params, trainable]
    total = trainable = nbytes = 0
    lazy = False
    for name, p in module.named_parameters():  # remove_duplicate=True: tied weights once
        n = _numel(p)
        lazy = lazy or isinstance(p, nn.parameter.UninitializedParameter)
        total += n
        trainable += n if p.requires_grad else 0
        nbytes += n * p.element_size() if n else 0
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, min(len(parts) - 1, max_depth) + 1)] or [_OWN]
        for prefix in prefixes:
            totals[prefix][0] += n
            totals[prefix][1] += n if p.requires_grad else 0

    rows: list[tuple[str, str, int, int]] = []

    def walk(mod: nn.Module, prefix: str, depth: int) -> None:
        for child_name, child in mod.named_children():
            path = prefix + child_name
            count = totals.get(path, [0, 0])
            rows.append((path, type(child).__name__, count[0], count[1]))
            if depth < max_depth:
                walk(child, path + ".", depth + 1)

    walk(module, "", 1)
    if _OWN in totals:
        rows.append((_OWN, "Parameter", totals[_OWN][0], totals[_OWN][1]))

    w_name = max([4, *(len(r[0]) for r in rows)])
    w_type = max([4, *(len(r[1]) for r in rows)])
    w_num = max([9, *(len(f"{r[2]:,}") for r in rows)])
    header = f"{'name':<{w_name}}  {'type':<{w_type}}  {'params':>{w_num}}  {'trainable':>{w_num}}"
    lines = [header, "-" * len(header)]
    lines += [f"{n:<{w_name}}  {t:<{w_type}}  {p:>{w_num},}  {tr:>{w_num},}" for n, t, p, tr in rows]
    lines.append("-" * len(header))
    lines.append(f"total params: {total:,}  trainable: {trainable:,}  non-trainable: {total - trainable:,}  "
                 f"size: {nbytes / 2**20:.2f} MB")
    if lazy:
        lines.append("(uninitialized lazy parameters counted as 0 until the first forward)")
    return "\n".join(lines)


__all__ = ["model_summary"]

"""Manual optimization under DDP: the ranks agree on each ``ctx.step`` before its gradients are
averaged, and on the end of each training step.

A rank whose ``training_step`` backpropagates through fewer parameters than another's (a branch
not taken, an expert no token chose, no ``ctx.backward`` at all) contributes zeros for them, as
DDP's reducer does for unused parameters; a parameter no rank has a gradient for keeps none (the
optimizer skips it, as on one process). A rank that skips a ``ctx.step`` another rank takes would
meet the others in a collective of another size (gloo aborts the process, NCCL hangs): instead
every rank raises one ``ModuleContractError`` naming the ranks, the step and the optimizers.

Each agreement is one all-reduce of 10 integers over a CPU (gloo) group: no device tensor is read,
so the step gains no host-device sync. One more all-reduce of a per-parameter flag follows only on
a step where some rank lacks a gradient the optimizer holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightlike.errors import ModuleContractError, on_every_rank

_STEP, _END = 1, 2  # what a rank is at: ctx.step of an optimizer, or the end of its training_step


class StepAgreement:
    """The agreement of one process group's ranks (``group``: a gloo group, None for the default
    one when it is gloo)."""

    def __init__(self, rank: int, world_size: int, group: Any = None):
        self.rank, self.world_size, self.group = rank, world_size, group

    def params_with_gradients(self, optimizer: torch.optim.Optimizer, step: int, index: int) -> list[torch.Tensor]:
        """The parameters of ``optimizer`` (``ctx.optimizers[index]``, at training step ``step``)
        whose gradients the ranks average: those with a gradient on some rank; a rank without one
        gets zeros. Raises on every rank when another rank is elsewhere."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        present = [p.grad is not None for p in params]
        fewest = self._agree([_STEP, step, index, len(params), sum(present)])
        if fewest == len(params):  # the usual case: every rank has every gradient
            return params
        flags = torch.tensor(present, dtype=torch.uint8)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        used = [p for p, flag in zip(params, flags.tolist(), strict=True) if flag]
        for p in used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return used

    def end_step(self, step: int, prepared: int) -> None:
        """The end of training step ``step``, in which this rank averaged ``prepared`` optimizers'
        gradients (``ctx.step``, ``ctx.clip_gradients``): every rank did as many."""
        self._agree([_END, step, prepared, 0, 0])

    def _agree(self, header: list[int]) -> int:
        """One all-reduce (the maximum of each field and of its negation): whether every rank's
        first 4 fields are this rank's; if not, each rank's header is gathered for the error.
        Returns the smallest last field (the fewest gradients a rank holds)."""
        both = torch.tensor(header + [-v for v in header], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        top = both.tolist()
        n = len(header)
        if any(top[i] != -top[n + i] for i in range(4)):
            mine = torch.tensor(header, dtype=torch.int64)
            parts = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(parts, mine, group=self.group)
            raise on_every_rank(ModuleContractError(_disagreement([p.tolist() for p in parts])))
        return -top[2 * n - 1]


def _disagreement(rows: list[list[int]]) -> str:
    def where(row: list[int]) -> str:
        kind, step, index, n_params, _ = row
        if kind == _END:
            return f"ended training_step {step} after {index} ctx.step call(s)"
        return f"called ctx.step(ctx.optimizers[{index}]) ({n_params} parameters) in training_step {step}"

    seen = "; ".join(f"rank {r} {where(row)}" for r, row in enumerate(rows))
    return (f"manual optimization under DDP: the ranks' training steps differ at step {min(r[1] for r in rows)}: "
            f"{seen}. Every rank must call ctx.step (or ctx.clip_gradients) for the same optimizers, in the same "
            "order, at every step: a rank with nothing to backpropagate still calls ctx.step (its gradients count as "
            "zeros, as DDP's reducer counts unused parameters); make the condition around ctx.step the same on "
            "every rank")

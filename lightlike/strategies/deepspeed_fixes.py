"""Workarounds for DeepSpeed faults met on the way (DeepSpeed 0.19.8, torch 2.13), each small,
guarded; the last three are each checked by a test in ``tests/strategies/test_deepspeed.py`` that fails
without it (named in brackets):

- ``init_deepspeed_comm``: skip a JIT build (about a minute on first use, needs a C++ compiler)
  that training never uses (a speed matter, not checked).
- ``share_zero3_master_partitions``: ZeRO-3 with fp32 parameters keeps a second fp32 copy of every
  partition because of a ``torch.device == str`` comparison (memory test).
- ``set_zero3_master_padded``: ZeRO-3's ``safe_set_full_fp32_param`` fails for parameters whose
  size does not divide by the world size (weights round trip).
- ``repair_zero3_universal_load``: ZeRO-3's universal-checkpoint load copies the first param
  group's settings to all groups and shares one ``step`` tensor between sub-groups (resume 2→1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightlike.errors import CheckpointError


def repair_zero3_universal_load(zero: Any, optimizer_state_file: Path) -> None:
    """Two faults of DeepSpeed's ZeRO-3 universal-checkpoint load
    (``stage3.py:load_hp_checkpoint_state_from_checkpoint_dir_stage3``), repaired after it:

    - every param group gets the settings of the first saved group, so lightlike's no-decay group
      (biases, norms) would get weight decay: each group's own saved settings are put back;
    - every sub-group's optimizer state gets the *same* ``step`` tensor object; ZeRO-3 steps the
      sub-groups one after the other and torch's Adam increments ``step`` in place, so the shared
      counter would advance once per sub-group and skew Adam's bias correction: each gets its own.
    """
    for st in zero.optimizer.state.values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"] = st["step"].clone()
    from lightlike.checkpoint.zero import load_deepspeed_file

    state = load_deepspeed_file(optimizer_state_file)
    saved = state["optimizer_state_dict"]["param_groups"]
    groups = zero.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer param groups, this run {len(groups)}")
    for group, old in zip(groups, saved, strict=True):
        group.update({k: v for k, v in old.items() if k != "params"})


def restore_buffers_after_universal_load(strategy: Any, module: Any, checkpoint_dir: Path) -> None:
    """DeepSpeed's universal load (``load_universal_checkpoint``) restores parameters and optimizer
    state but skips ``load_module_state_dict``: buffers (BatchNorm statistics) came back at their
    constructor values. They are copied from the checkpoint's own model states: rank 0 reads them
    (only them), every rank receives them. Non-persistent buffers are not saved and stay as built."""
    from lightlike.checkpoint.zero import consolidated_state_dict

    names = {n for n, _ in module.named_buffers()}
    saved: dict[str, torch.Tensor] = consolidated_state_dict(checkpoint_dir, only=names) if strategy.is_global_zero else {}
    if strategy.world_size > 1:
        saved = strategy.collectives.broadcast_object(saved)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in saved:
                buffer.copy_(saved[name].to(buffer.device, buffer.dtype))


def set_zero3_master_padded(p: Any, value: torch.Tensor) -> None:
    """``safe_set_full_fp32_param`` for a ZeRO-3 parameter whose size does not divide by the world
    size: DeepSpeed's setter slices the unpadded value at ``rank * partition_size`` (a 3-element
    bias on 2 ranks fails on rank 1) and refuses a padded one; this is its code with the padding."""
    opt = p._z3_optimizer
    part, group = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)
    n = part.numel()
    flat = value.detach().float().reshape(-1).to(part.device)
    flat = torch.cat([flat, flat.new_zeros(max(0, n * opt._get_param_partition_world_size(p) - flat.numel()))])
    rank = opt._get_param_partition_rank(p)
    part.data.copy_(flat[rank * n:(rank + 1) * n])
    if opt._swappable_optimizer_subgroup(group):
        opt._optimizer_states_and_gradient_swap_out(group)


def share_zero3_master_partitions(zero: Any) -> None:
    """ZeRO-3 whose parameters are already fp32 (``32-true``, ``*-mixed``): let the fp32 master
    partitions *be* the parameter partitions, as DeepSpeed intends ("we don't need another copy of
    the weights", ``stage3.py:_create_fp32_partitions``). DeepSpeed's test compares a tensor's
    ``torch.device`` with its device *string* (``tensor.device == self.device``), which is false
    (torch 2.13: a device never equals a string), so it always clones: one more fp32 copy of the partition per rank (4 bytes/param/world
    size). Sharing the storage changes no number: the optimizer updates the master partition in
    place and DeepSpeed then copies it into the parameter partition, now the same memory."""
    lp_groups = getattr(zero, "fp16_partitioned_groups_flat", None)
    hp_groups = getattr(zero, "fp32_partitioned_groups_flat", None)
    if not lp_groups or not hp_groups or getattr(zero, "offload_optimizer", False) or getattr(zero, "offload_param", False):
        return
    swappable = getattr(zero, "_swappable_optimizer_subgroup", lambda i: True)
    for i, (lp, hp) in enumerate(zip(lp_groups, hp_groups, strict=True)):
        if lp is None or hp is lp or swappable(i):
            continue
        if lp.dtype == hp.dtype and lp.device == hp.device and lp.shape == hp.shape and torch.equal(lp, hp) \
                and lp.untyped_storage().data_ptr() != hp.untyped_storage().data_ptr():
            hp.data = lp.data


def init_deepspeed_comm() -> None:
    """``deepspeed.init_distributed`` on the process group that already exists (DeepSpeed then wraps
    it instead of starting one). DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce
    kernel on CPU when it is created (about a minute, and a C++ compiler needed) that only
    ``inference_all_reduce`` uses, which training never calls: that build is skipped."""
    import importlib

    import deepspeed

    # the module itself: deepspeed.comm re-exports the name ``torch`` (the torch package) over it
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    build = getattr(ds_torch, "build_shm_op", None)
    if build is not None:
        ds_torch.build_shm_op = lambda: None  # type: ignore[attr-defined]
    try:
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False, verbose=False)
    finally:
        if build is not None:
            ds_torch.build_shm_op = build  # type: ignore[attr-defined]

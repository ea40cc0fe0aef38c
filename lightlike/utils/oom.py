"""``auto_find_batch_size``: retry a fit with a smaller batch after running out of memory."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightlike.fitter import Fitter
    from lightlike.state import FitResult

log = logging.getLogger("lightlike")


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError (the text the HF Trainer matches)."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def fit_finding_batch_size(fitter: Fitter, module: Any, train: Any, val: Any, resume: Any) -> FitResult:
    """On out-of-memory, halve the batch, double the accumulation (the same items per step) and
    start again from the module's initial weights, down to batch size 1."""
    from torch.utils.data import DataLoader

    if isinstance(train, DataLoader):  # its batch size is its own: halving batch_size would change nothing
        from lightlike.errors import ConfigError

        raise ConfigError("auto_find_batch_size=True needs the training Dataset, not a DataLoader (the Fitter "
                          "cannot change a DataLoader's batch size): pass the Dataset, or drop auto_find_batch_size")
    snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
    while True:
        try:
            return fitter._fit(module, train, val, resume)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            cfg = fitter.config
            if not is_out_of_memory(error) or cfg.batch_size == 1:
                raise
            if fitter.strategy is not None and fitter.strategy.world_size > 1:
                # the other ranks did not run out: they wait in this step's collectives, and a retry
                # on this rank alone would start a new fit's collectives against them (a hang)
                log.error("out of memory at batch_size=%d on rank %d: auto_find_batch_size retries on one "
                          "process only; set a smaller batch_size", cfg.batch_size, fitter.strategy.global_rank)
                raise
            fitter._commit_checkpoint()  # an asynchronous save of the failed try lands before the retry clears it
            fitter._signal_carried = getattr(  # type: ignore[attr-defined]
                getattr(fitter, "_preemption", None), "received", None)  # not lost
            new_bs, new_acc = cfg.batch_size // 2, cfg.grad_accum_steps * 2
            log.warning("out of memory at batch_size=%d: retrying from the start with batch_size=%d, "
                        "grad_accum_steps=%d", cfg.batch_size, new_bs, new_acc)
            fitter.config = cfg.replace(batch_size=new_bs, grad_accum_steps=new_acc, overwrite_output_dir=True)
            module.load_state_dict(snapshot)
            module.zero_grad(set_to_none=True)  # the failed step's partial gradients
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

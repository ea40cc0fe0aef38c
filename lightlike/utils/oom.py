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


def smaller_batch(batch_size: int, accum: int) -> tuple[int, int]:
    """About half the batch with the same items per step: the largest divisor of
    ``batch_size * accum`` up to ``batch_size // 2``, and the accumulation that makes it up
    (16 x 1 -> 8 x 2; 12 x 1 -> 6 x 2 -> 3 x 4 -> 1 x 12; 5 x 1 -> 1 x 5)."""
    items = batch_size * accum
    new = next(d for d in range(max(1, batch_size // 2), 0, -1) if items % d == 0)
    return new, items // new


def _rotate_resume_source(fitter: Fitter) -> None:
    """The checkpoint the fit resumed from was kept from rotation for a retry; the fit is done, so
    rotation counts it like any other again (save_total_limit holds as without the option)."""
    strategy = fitter.strategy
    if not (fitter.config.save_total_limit and fitter.resumed_from and strategy is not None):
        return
    if strategy.is_global_zero:
        from lightlike.checkpoint.training import rotate

        rotate(fitter)
    strategy.collectives.barrier("save")


def fit_finding_batch_size(fitter: Fitter, module: Any, train: Any, val: Any, resume: Any) -> FitResult:
    """On out-of-memory, about halve the batch with the same items per step (``smaller_batch``)
    and start again from the module's initial weights and the place the first try started
    (fresh, or the checkpoint it resumed), down to batch size 1."""
    from torch.utils.data import DataLoader

    if isinstance(train, DataLoader):  # its batch size is its own: halving batch_size would change nothing
        from lightlike.errors import ConfigError

        raise ConfigError("auto_find_batch_size=True needs the training Dataset, not a DataLoader (the Fitter "
                          "cannot change a DataLoader's batch size): pass the Dataset, or drop auto_find_batch_size")
    snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
    fitter.__dict__.pop("_resume_choice", None)
    while True:
        try:
            result = fitter._fit(module, train, val, resume)
            _rotate_resume_source(fitter)
            return result
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
            new_bs, new_acc = smaller_batch(cfg.batch_size, cfg.grad_accum_steps)
            log.warning("out of memory at batch_size=%d: retrying from the start with batch_size=%d, "
                        "grad_accum_steps=%d", cfg.batch_size, new_bs, new_acc)
            fitter.config = cfg.replace(batch_size=new_bs, grad_accum_steps=new_acc, overwrite_output_dir=True)
            if "_resume_choice" in fitter.__dict__:  # where the first try started is where every retry starts:
                choice = fitter.__dict__.pop("_resume_choice")  # not a checkpoint the failed try wrote
                resume = None if choice is None else str(choice)  # (newer ones are set aside on resume)
            if fitter.strategy is not None:  # the module as the failed try left it (FSDP: sharded in place)
                fitter.strategy.load_module_state_dict(module, snapshot)
                fitter.strategy.discard_gradients(module)  # the failed step's partial gradients
            else:
                module.load_state_dict(snapshot)
                module.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

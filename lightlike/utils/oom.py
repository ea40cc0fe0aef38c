"""``auto_find_batch_size``: retry a fit with a smaller batch after running out of memory."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightlike.errors import ConfigError, ModuleContractError
from lightlike.lazy import lazy_modules

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


class OutOfMemoryRetry:
    """``auto_find_batch_size``: on out-of-memory, ``Fitter.fit`` starts again with about half the
    batch and the same items per step (``smaller_batch``), from the module's initial weights and
    the place the first try started (fresh, or the checkpoint it resumed), down to batch size 1.
    The fit's loop calls ``applies``, then ``next_try``; ``release_resume_source`` once it ends."""

    def __init__(self, module: Any, train: Any, states: dict[str, Any] | None = None):
        if isinstance(train, DataLoader):  # its batch size is its own: halving batch_size would change nothing
            raise ConfigError("auto_find_batch_size=True needs the training Dataset, not a DataLoader (the Fitter "
                              "cannot change a DataLoader's batch size): pass the Dataset, or drop "
                              "auto_find_batch_size")
        if lazy := lazy_modules(module):  # no first weights to start a retry from
            raise ModuleContractError(f"auto_find_batch_size=True keeps the module's first weights for a retry, but "
                                      f"{lazy} have parameters that are not initialised yet (lazy modules): run one "
                                      "forward pass before fit() (with torch.no_grad(): module(batch)), or drop "
                                      "auto_find_batch_size")
        self.module, self.states = module, dict(states or {})
        self.snapshot = {k: v.detach().clone() for k, v in module.state_dict().items()}
        # the user's states (Fitter(states=...)) as the first try found them, for the next try
        self.state_snapshots = {name: copy.deepcopy(s.state_dict()) for name, s in self.states.items()}

    def applies(self, error: BaseException, config: Any, strategy: Any) -> bool:
        """Whether ``error`` is an out-of-memory error a smaller batch may avoid."""
        if not is_out_of_memory(error) or config.batch_size == 1:
            return False
        if strategy is not None and strategy.world_size > 1:
            # the other ranks did not run out: they wait in this step's collectives, and a retry
            # on this rank alone would start a new fit's collectives against them (a hang)
            log.error("out of memory at batch_size=%d on rank %d: auto_find_batch_size retries on one "
                      "process only; set a smaller batch_size", config.batch_size, strategy.global_rank)
            return False
        return True

    def next_try(self, config: Any, strategy: Any, first_start: Any) -> tuple[Any, str | None]:
        """The next try's config and ``resume``: where the first try started (``first_start``),
        not a checkpoint the failed try wrote (newer ones are set aside on resume). The module and
        the user's states are put back as the failed try found them."""
        new_bs, new_acc = smaller_batch(config.batch_size, config.grad_accum_steps)
        log.warning("out of memory at batch_size=%d: retrying from the start with batch_size=%d, "
                    "grad_accum_steps=%d", config.batch_size, new_bs, new_acc)
        if strategy is not None:  # the module as the failed try left it (FSDP: sharded in place)
            strategy.checkpoint_layout.load_module_state_dict(self.module, self.snapshot)
            strategy.discard_gradients(self.module)  # the failed step's partial gradients
        else:
            self.module.load_state_dict(self.snapshot)
            self.module.zero_grad(set_to_none=True)
        for name, saved in self.state_snapshots.items():
            self.states[name].load_state_dict(copy.deepcopy(saved))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        resume = None if first_start is None else str(first_start)
        return config.replace(batch_size=new_bs, grad_accum_steps=new_acc, overwrite_output_dir=True), resume

    @staticmethod
    def release_resume_source(checkpointer: Any, strategy: Any) -> None:
        """The checkpoint the fit resumed from was kept from rotation for a retry; the fit is done,
        so rotation counts it like any other again (save_total_limit holds as without the option)."""
        if not (checkpointer.config.save_total_limit and checkpointer.resumed_from):
            return
        if strategy.is_global_zero:
            checkpointer.rotate()
        strategy.collectives.barrier("save")

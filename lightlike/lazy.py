"""Lazily initialised modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...): materialised at set-up.

Their parameters get a shape at the first forward pass, and until then an optimizer cannot be
built over them, nor can a strategy wrap or shard them. So before the strategy sees the module,
``materialise_lazy_modules`` runs one dry forward pass on a batch of the training data's first
item (``dataset[0]``, collated by the loader's ``collate_fn``), as Lightning's docs advise:

- in eval mode (no dropout, no update of BatchNorm's running statistics) and under
  ``torch.no_grad()``; every submodule's mode is put back as it was;
- the item is read with the random streams kept (a random augmentation in ``__getitem__``
  draws nothing from training's streams), and the forward pass draws the lazy parameters'
  initial values from the streams as the set-up left them, as the first training forward
  would have: training goes on from there as a hand-written loop whose first forward pass
  materialised the module (exactly so where no random draw comes before the lazy layers);
- the sampler and the loader's iterator are not touched: the data order is unchanged.

Training data whose first item cannot be read alone (an IterableDataset, a loader of
ready-made batches) is refused with an error that names the lazy modules and the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.data import IterableDataset

from lightlike.errors import ModuleContractError
from lightlike.strategies.base import move_to_device
from lightlike.utils.seed import rng_kept


def lazy_modules(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s submodules whose parameters are not initialised yet."""
    return [name or type(m).__name__ for name, m in module.named_modules()
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]  # type: ignore[operator]


def materialise_lazy_modules(module: torch.nn.Module, loader: Any) -> None:
    """Give every lazily initialised parameter of ``module`` its shape and initial values with
    one dry forward pass (module docstring); nothing happens for a module without any."""
    lazy = lazy_modules(module)
    if not lazy:
        return
    fix = ("run one forward pass before fit() (with torch.no_grad(): module(batch)), or give the layers their "
           "input sizes (nn.Linear(in_features, ...) for nn.LazyLinear)")
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset) or loader.batch_sampler is None:
        raise ModuleContractError(f"{lazy} have parameters that are not initialised yet (lazy modules), and the "
                                  f"training data's first item cannot be read alone to initialise them: {fix}")
    with rng_kept():
        batch = loader.collate_fn([dataset[0]])
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            module(move_to_device(batch, device))
    finally:  # each submodule's mode as it was (a frozen BatchNorm in a training module stays frozen)
        for m, mode in modes:
            m.training = mode
    if left := lazy_modules(module):
        raise ModuleContractError(f"{left} have parameters that are still not initialised after a forward pass of "
                                  f"the training data's first item in eval mode: {fix}")

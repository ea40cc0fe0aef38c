"""Bridges to the libraries people already use, each an optional dependency imported only when
used (``import lightlike`` imports none of them):

* ``lightlike.interop.hf``: train a ``transformers`` causal LM (``HFCausalLM``) or any model that
  computes its own loss (``HFModel``: classification, question answering, seq2seq) and export a
  checkpoint as a folder ``from_pretrained`` loads (``export_hf``);
* ``lightlike.interop.metrics``: ``torchmetrics`` objects as streaming metrics, reduced across
  processes (``TorchMetric``);
* ``lightlike.search``: hyperparameter search over ``optuna`` (``Fitter.search``).
* ``lightlike.interop.neftune`` and ``lightlike.interop.liger``: what ``neftune_noise_alpha`` and
  ``use_liger_kernel`` do at a fit's set-up (liger-kernel is imported only with the latter).
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "HFCausalLM": "lightlike.interop.hf",
    "HFModel": "lightlike.interop.hf",
    "export_hf": "lightlike.interop.hf",
    "TorchMetric": "lightlike.interop.metrics",
}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'lightlike.interop' has no attribute {name!r}")


__all__ = list(_NAMES)

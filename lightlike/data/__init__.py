"""Data utilities: collators, the length-grouped sampler, and removal of unused batch keys."""

from lightlike.data.collators import LanguageModelingCollator, PaddingCollator, count_label_tokens
from lightlike.data.keys import remove_unused_keys
from lightlike.data.length_grouped import LengthGroupedSampler

__all__ = [
    "LanguageModelingCollator",
    "LengthGroupedSampler",
    "PaddingCollator",
    "count_label_tokens",
    "remove_unused_keys",
]

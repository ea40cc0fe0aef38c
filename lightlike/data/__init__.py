"""Data utilities: collators, the resumable and length-grouped samplers, and removal of unused batch keys."""

from lightlike.data.collators import LanguageModelingCollator, PaddingCollator, count_label_tokens
from lightlike.data.hf_datasets import HFCollator
from lightlike.data.keys import remove_unused_keys
from lightlike.data.length_grouped import LengthGroupedSampler
from lightlike.data.sampler import ResumableSampler

__all__ = [
    "HFCollator",
    "LanguageModelingCollator",
    "LengthGroupedSampler",
    "PaddingCollator",
    "ResumableSampler",
    "count_label_tokens",
    "remove_unused_keys",
]

"""Collators: dynamic padding, language-modelling labels, and the token count that makes
gradient accumulation exact over tokens.

``PaddingCollator`` pads variable-length sequence fields to the batch's longest one.
``LanguageModelingCollator`` builds causal-LM or masked-LM (BERT) batches on top of it; its masks
are a pure function of (seed, epoch, each sequence's tokens), so they are the same with any
number of DataLoader workers, any batch composition, and after a resume. ``count_label_tokens``
is what ``TaskModule.num_items`` should return when the loss is a mean over label tokens.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import struct
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from lightlike.errors import DataError

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index

#: fields padded with something other than 0 by default (others: 0)
_ALIGNED_WITH_INPUT_IDS = ("attention_mask", "token_type_ids", "special_tokens_mask", "position_ids")


def count_label_tokens(batch: Any, ignore_index: int = IGNORE_INDEX, *, key: str = "labels",
                       shift: bool = False) -> torch.Tensor:
    """How many label tokens of ``batch`` the loss averages over: ``(labels != ignore_index).sum()``.

    Return it from ``TaskModule.num_items`` when ``loss`` is the mean over label tokens (a
    cross-entropy with ``ignore_index=-100``). The Fitter then weights every micro-batch by its
    token count, so the step's gradient is that of the mean loss over every real token of the
    step, however unevenly the micro-batches are padded. The count is a tensor on the labels'
    device (no host synchronisation).

    ``shift=True`` counts ``labels[..., 1:]``: a causal LM predicts token t+1 from tokens up to t,
    so the first label of each row is never a target (use it when the loss compares
    ``logits[:, :-1]`` with ``labels[:, 1:]``), nor is one predicted from a padding position
    (left padding; ``mask_padded_context``, when the batch holds an ``attention_mask``). ``batch`` is a mapping holding ``key`` or the
    labels tensor itself. A micro-batch without any label token makes a mean-reduced
    cross-entropy NaN; ``cross_entropy(..., reduction="sum") / count.clamp(min=1)`` is 0 there.
    """
    labels = batch[key] if isinstance(batch, Mapping) else batch
    if not isinstance(labels, torch.Tensor):
        raise DataError(f"count_label_tokens needs the labels as a tensor, got {type(labels).__name__}")
    if shift:
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        labels = mask_padded_context(labels[..., 1:], mask, ignore_index)
    return (labels != ignore_index).sum()


def mask_padded_context(shifted: torch.Tensor, attention_mask: torch.Tensor | None,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets ``labels[..., 1:]`` with those predicted from a padding position
    (``attention_mask[..., :-1] == 0``) set to ``ignore_index``: under left padding the first
    real token of a padded row follows a pad, and counting it would make the loss of an item
    depend on the batch it is in. Right padding whose pads are labelled -100 is unchanged (labels
    that keep the pad tokens lose the targets a pad predicts: padding, not data)."""
    if (attention_mask is None or attention_mask.ndim != shifted.ndim
            or attention_mask.shape[:-1] != shifted.shape[:-1] or attention_mask.shape[-1] != shifted.shape[-1] + 1):
        return shifted  # not a padding mask of these labels (a 4-D packing mask, say): as it is
    return shifted.masked_fill(attention_mask[..., :-1] == 0, ignore_index)


def _as_tensor(value: Any, field: str, index: int) -> torch.Tensor | None:
    """A tensor for a numeric value (number, list of numbers, array, tensor); None otherwise."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if isinstance(value, (list, tuple)) and any(isinstance(v, (str, bytes)) for v in value):
        return None  # words, not numbers
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        if isinstance(value, (list, tuple)):
            raise DataError(f"field {field!r} of item {index} is not a sequence of numbers of one shape "
                            f"({type(value).__name__} starting {value[:3]!r}): {e}") from e
        return None


class PaddingCollator:
    """Pads variable-length 1-D sequence fields of a list of dict items to the batch's maximum.

    * ``keys``: the fields to pad. ``None``: every field holding a list/tuple or a 1-D tensor.
      Other fields are stacked (numbers and equal-shape tensors) or passed on as lists (strings).
    * ``input_ids`` (and fields whose name contains it) pad with ``pad_token_id``; ``labels`` (and
      fields whose name contains ``labels``, and ``label``, ``label_ids``) with ``label_pad_id`` (-100, which cross-entropy
      ignores); ``special_tokens_mask`` with 1; anything else with 0. ``pad_values`` overrides.
    * When items have ``input_ids`` but no ``attention_mask``, an ``attention_mask`` (1 on real
      tokens, 0 on padding) is added, right after ``input_ids``.
    * ``padding_side``: ``"right"`` (usual for training) or ``"left"`` (batched generation).
    * ``pad_to_multiple_of``: round the padded length up (tensor cores like multiples of 8).

    Each field is padded to its own longest value, so sequence-to-sequence ``labels`` may be
    longer or shorter than ``input_ids``. A malformed item raises ``DataError`` naming the item
    and the field.
    """

    def __init__(self, pad_token_id: int = 0, padding_side: str = "right", pad_to_multiple_of: int | None = None,
                 label_pad_id: int = IGNORE_INDEX, keys: Collection[str] | None = None,
                 pad_values: Mapping[str, int | float] | None = None) -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        if isinstance(keys, str):
            raise TypeError(f"keys must be a collection of field names, got the string {keys!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.label_pad_id = label_pad_id
        self.keys = None if keys is None else tuple(keys)
        self.pad_values = dict(pad_values or {})

    def pad_value(self, field: str) -> int | float:
        if field in self.pad_values:
            return self.pad_values[field]
        if "input_ids" in field:
            return self.pad_token_id
        if _is_label(field):  # as HF's token-classification collator
            return self.label_pad_id
        if field == "special_tokens_mask":
            return 1
        return 0

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        fields = _check_items(items, "PaddingCollator")
        if self.keys is not None:
            missing = [k for k in self.keys if k not in fields]
            if missing:
                raise DataError(f"PaddingCollator(keys=...) names field(s) {missing} that the items do not have "
                                f"(they have {fields})")
        out: dict[str, Any] = {}
        lengths: dict[str, list[int]] = {}
        for field in fields:
            values = [item[field] for item in items]
            pad = self._is_sequence_field(field, values)
            tensors = [_as_tensor(v, field, i) for i, v in enumerate(values)]
            if pad:
                bad = [i for i, t in enumerate(tensors) if t is None or t.ndim != 1]
                if bad:
                    i, t = bad[0], tensors[bad[0]]
                    got = type(values[i]).__name__ if t is None else f"a {t.ndim}-D value of shape {tuple(t.shape)}"
                    raise DataError(f"field {field!r} of item {i} is {got}; PaddingCollator pads 1-D sequences "
                                    "(a list or 1-D tensor per item)")
                lengths[field] = [len(t) for t in tensors]  # type: ignore[arg-type]
                out[field] = self._pad(tensors, self.pad_value(field), long_ints=_is_label(field))  # type: ignore[arg-type]
                if field == "input_ids" and "attention_mask" not in fields:
                    out["attention_mask"] = self._pad([torch.ones(n, dtype=torch.long) for n in lengths[field]], 0)
            else:
                out[field] = _stack(field, values, tensors, long_ints=_is_label(field))
        _check_aligned(lengths)
        return out

    def _is_sequence_field(self, field: str, values: list[Any]) -> bool:
        if self.keys is not None:
            return field in self.keys
        first = values[0]
        if isinstance(first, torch.Tensor):
            return first.ndim == 1
        if isinstance(first, (list, tuple)):  # of numbers (a list of words is passed on as it is),
            # judged by the first non-empty one: an empty list says nothing (all empty: padded)
            first = next((v for v in values if isinstance(v, (list, tuple)) and len(v)), first)
            return all(_is_scalar(v) for v in first)
        return getattr(first, "ndim", None) == 1  # e.g. a numpy array

    def _pad(self, tensors: list[torch.Tensor], value: int | float, long_ints: bool = False) -> torch.Tensor:
        """Padded into one tensor of the items' dtype; integers as int64 where ``long_ints``
        (labels: what cross_entropy takes, as HF's collators give) or where ``value`` does not
        fit the items' integer dtype (-100 in uint8 labels became 156, a class)."""
        longest = max(len(t) for t in tensors)
        if self.pad_to_multiple_of:
            longest = math.ceil(longest / self.pad_to_multiple_of) * self.pad_to_multiple_of
        dtype = _common_dtype(tensors)
        if dtype.is_floating_point or dtype.is_complex:
            pass
        elif isinstance(value, float) and not value.is_integer():  # 0.5 became 0 (or True)
            dtype = torch.get_default_dtype()
        elif dtype == torch.bool:  # -100 (or any value but 0/1) in a bool tensor is True
            if long_ints or value not in (0, 1):
                dtype = torch.int64
        elif long_ints or not torch.iinfo(dtype).min <= value <= torch.iinfo(dtype).max:
            dtype = torch.int64
        out = torch.full((len(tensors), longest), value, dtype=dtype)
        for i, t in enumerate(tensors):
            n = len(t)
            if n:
                if self.padding_side == "right":
                    out[i, :n] = t
                else:
                    out[i, longest - n:] = t
        return out


def _is_label(field: str) -> bool:
    return "labels" in field or field in ("label", "label_ids")


def _is_scalar(value: Any) -> bool:
    """A single number: a Python one, a numpy scalar (``list(np.array([1, 2]))`` holds
    ``np.int64`` values, which are no ``int``) or a 0-d array or tensor."""
    if isinstance(value, (str, bytes)):
        return False
    return isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def _common_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The promoted dtype of the non-empty values (an empty list alone would read as float)."""
    dtype: torch.dtype | None = None
    for t in tensors:
        if t.numel():
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype if dtype is not None else torch.long


def _check_items(items: Any, who: str) -> list[str]:
    if isinstance(items, Mapping) or not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise DataError(f"{who} takes a list of items (dicts of fields), got {type(items).__name__}")
    if not items:
        raise DataError(f"{who} got an empty list of items")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise DataError(f"item {i} is a {type(item).__name__}; {who} expects every item to be a dict of "
                            "fields such as {'input_ids': [...], 'labels': [...]}")
    fields = list(items[0].keys())
    for i, item in enumerate(items[1:], start=1):
        if item.keys() != items[0].keys():
            missing = [k for k in fields if k not in item]
            extra = [k for k in item if k not in items[0]]
            what = f"lacks field(s) {missing}" if missing else f"has field(s) {extra} that item 0 lacks"
            raise DataError(f"item {i} {what}: every item of a batch needs the same fields (item 0 has {fields})")
    return fields


def _stack(field: str, values: list[Any], tensors: list[torch.Tensor | None], long_ints: bool = False) -> Any:
    if any(t is None for t in tensors):
        return list(values)  # strings, None, objects: passed on as they are
    shapes = {tuple(t.shape) for t in tensors}  # type: ignore[union-attr]
    if len(shapes) > 1:
        raise DataError(f"field {field!r} has values of different shapes {sorted(shapes)} across items and is not "
                        "padded; pass it in PaddingCollator(keys=...) if it is a 1-D sequence")
    dtype = _common_dtype(tensors)  # type: ignore[arg-type]
    if long_ints and not (dtype.is_floating_point or dtype.is_complex):  # class labels: what cross_entropy takes
        dtype = torch.int64
    return torch.stack([t.to(dtype) for t in tensors])  # type: ignore[union-attr]


def _check_aligned(lengths: dict[str, list[int]]) -> None:
    """Per-token fields must be as long as input_ids in every item."""
    if "input_ids" not in lengths:
        return
    for field in _ALIGNED_WITH_INPUT_IDS:
        if field in lengths:
            for i, (a, b) in enumerate(zip(lengths["input_ids"], lengths[field], strict=True)):
                if a != b:
                    raise DataError(f"item {i}: field {field!r} has {b} values but 'input_ids' has {a}; "
                                    "per-token fields must be as long as input_ids")


class LanguageModelingCollator:
    """Batches for language modelling: causal (``mlm=False``) or masked (``mlm=True``).

    Items are dicts with ``input_ids`` (a list or 1-D tensor; other fields are padded or stacked
    as ``PaddingCollator`` does) or bare token sequences. The batch gets ``input_ids``,
    ``attention_mask`` and ``labels``:

    * **Causal**: ``labels`` is a copy of ``input_ids`` with -100 on padding (found from the
      attention mask, not by token value, so a real EOS that doubles as the pad token keeps its
      label). Labels are **not shifted**: the module compares ``logits[:, :-1]`` with
      ``labels[:, 1:]`` (and counts with ``count_label_tokens(batch, shift=True)``). An item that
      brings its own ``labels`` (e.g. -100 on a prompt) keeps them, padded with -100.
    * **Masked** (BERT): each eligible token is selected with probability ``mlm_probability``;
      a selected token becomes ``mask_token_id`` with probability ``mask_replace_prob`` (0.8), a
      uniformly random token of ``range(vocab_size)`` with probability ``random_replace_prob``
      (0.1), and stays as it is otherwise; ``labels`` holds the original token at selected
      positions and -100 everywhere else. Padding, ``pad_token_id``, ``special_token_ids`` and
      positions flagged by an item's ``special_tokens_mask`` field are never selected.

    **Determinism.** The masking of a sequence is drawn from a generator seeded with a hash of
    ``(seed, epoch, its tokens)``: a pure function, with no random stream carried from batch to
    batch. So the same items get the same masks whichever DataLoader worker collates them, with
    any ``num_workers``, in any batch or on any rank, and after a kill and mid-epoch resume (which
    seeks instead of replaying batches, so a stream would not be reproduced). ``seed`` may be an
    int or a ``torch.Generator`` (its ``initial_seed()`` is used). ``epoch`` comes from
    ``epoch_source.epoch`` when given (pass the DataLoader's sampler: the Fitter sets its epoch
    before each epoch's iterator, and DataLoader workers, started with each iterator, carry a
    copy), else from ``set_epoch``; with ``persistent_workers=True`` workers keep the epoch they
    started with. A sequence that occurs twice in one epoch gets the same mask both times.
    """

    def __init__(self, pad_token_id: int, mlm: bool = False, mlm_probability: float = 0.15,
                 mask_token_id: int | None = None, vocab_size: int | None = None, *,
                 seed: int | torch.Generator = 0, special_token_ids: Collection[int] = (),
                 mask_replace_prob: float = 0.8, random_replace_prob: float = 0.1,
                 padding_side: str = "right", pad_to_multiple_of: int | None = None,
                 epoch_source: Any = None) -> None:
        if mlm:
            if mask_token_id is None or vocab_size is None:
                raise ValueError("LanguageModelingCollator(mlm=True) needs mask_token_id and vocab_size "
                                 "(the token that replaces masked ones, and the range random tokens come from)")
            if not 0.0 <= mlm_probability <= 1.0:
                raise ValueError(f"mlm_probability must be in [0, 1], got {mlm_probability}")
            if mask_replace_prob < 0 or random_replace_prob < 0 or mask_replace_prob + random_replace_prob > 1:
                raise ValueError("mask_replace_prob and random_replace_prob must be >= 0 and sum to at most 1, "
                                 f"got {mask_replace_prob} and {random_replace_prob}")
        self.pad_token_id = pad_token_id
        self.mlm = mlm
        self.mlm_probability = mlm_probability
        self.mask_token_id = mask_token_id
        self.vocab_size = vocab_size
        self.seed = int(seed.initial_seed()) if isinstance(seed, torch.Generator) else int(seed)
        self.special_token_ids = tuple(int(t) for t in special_token_ids)
        self.mask_replace_prob = mask_replace_prob
        self.random_replace_prob = random_replace_prob
        self.epoch_source = epoch_source
        self.epoch = 0
        self.padder = PaddingCollator(pad_token_id, padding_side=padding_side, pad_to_multiple_of=pad_to_multiple_of)

    def set_epoch(self, epoch: int) -> None:
        """The epoch mixed into the masking seed (ignored when ``epoch_source`` is given)."""
        self.epoch = int(epoch)

    def current_epoch(self) -> int:
        if self.epoch_source is not None:
            return int(getattr(self.epoch_source, "epoch", 0))
        return self.epoch

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
            items = [x if isinstance(x, Mapping) else {"input_ids": x} for x in items]  # bare token sequences
        fields = _check_items(items, "LanguageModelingCollator")
        if "input_ids" not in fields:
            raise DataError(f"LanguageModelingCollator needs an 'input_ids' field; the items have {fields}")
        if self.mlm and "labels" in fields:
            raise DataError("LanguageModelingCollator(mlm=True) makes the labels itself; the items already have a "
                            "'labels' field: drop it, or use PaddingCollator")
        epoch = self.current_epoch()
        prepared = []
        for i, item in enumerate(items):
            ids = _as_tensor(item["input_ids"], "input_ids", i)
            if ids is not None and ids.numel() == 0 and ids.ndim == 1:
                ids = ids.long()  # an empty sequence: torch.as_tensor([]) is float
            if ids is None or ids.ndim != 1 or ids.is_floating_point() or ids.is_complex():
                raise DataError(f"field 'input_ids' of item {i} must be a 1-D sequence of integer token ids, got "
                                f"{type(item['input_ids']).__name__}"
                                + (f" of shape {tuple(ids.shape)} and dtype {ids.dtype}" if ids is not None else ""))
            ids = ids.long()
            real = torch.ones(len(ids), dtype=torch.bool)
            if "attention_mask" in item:
                mask = _as_tensor(item["attention_mask"], "attention_mask", i)
                if mask is None or mask.shape != ids.shape:
                    raise DataError(f"item {i}: 'attention_mask' must have the shape of 'input_ids' {tuple(ids.shape)}")
                real = mask.bool()
            new = dict(item)
            if self.mlm:
                special = None
                if "special_tokens_mask" in item:
                    special = _as_tensor(item["special_tokens_mask"], "special_tokens_mask", i)
                    if special is None or special.shape != ids.shape:
                        raise DataError(f"item {i}: 'special_tokens_mask' must have the shape of 'input_ids' "
                                        f"{tuple(ids.shape)}")
                    del new["special_tokens_mask"]
                new["input_ids"], new["labels"] = self.mask_tokens(ids, real, special, epoch)
            else:
                new["input_ids"] = ids
                if "labels" not in item:
                    new["labels"] = torch.where(real, ids, torch.full_like(ids, IGNORE_INDEX))
            prepared.append(new)
        return self.padder(prepared)

    def mask_tokens(self, ids: torch.Tensor, real: torch.Tensor, special: torch.Tensor | None = None,
                    epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked copy of one sequence and its labels (-100 where not selected)."""
        assert self.mask_token_id is not None and self.vocab_size is not None
        eligible = real & (ids != self.pad_token_id)
        for t in self.special_token_ids:
            eligible &= ids != t
        if special is not None:
            eligible &= ~special.bool()
        g = torch.Generator()
        g.manual_seed(sequence_seed(self.seed, epoch, ids))
        n = len(ids)
        selected = (torch.rand(n, generator=g, dtype=torch.float64) < self.mlm_probability) & eligible
        kind = torch.rand(n, generator=g, dtype=torch.float64)
        random_tokens = torch.randint(self.vocab_size, (n,), generator=g, dtype=torch.long)
        to_mask = selected & (kind < self.mask_replace_prob)
        to_random = selected & (kind >= self.mask_replace_prob) & (kind < self.mask_replace_prob + self.random_replace_prob)
        inputs = torch.where(to_mask, torch.full_like(ids, self.mask_token_id), ids)
        inputs = torch.where(to_random, random_tokens, inputs)
        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
        return inputs, labels


def sequence_seed(seed: int, epoch: int, ids: torch.Tensor) -> int:
    """A 63-bit seed from (seed, epoch, token ids): blake2b, the same on every platform and run."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qq", seed, epoch))
    h.update(ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

"""Collators, LengthGroupedSampler, EveryNth, remove_unused_keys and ShardedIterable pinned to exact
values at the edges the older tests left open (mutation round 12, auditor BL): single-process, fast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightlike.data import LengthGroupedSampler, PaddingCollator, remove_unused_keys
from lightlike.data.collators import mask_padded_context
from lightlike.data.iterable import ShardedIterable
from lightlike.data.sampler import EveryNth
from lightlike.errors import DataError


def test_a_mask_as_long_as_the_shifted_labels_is_not_a_padding_mask_of_them():
    # the mask must be one longer than labels[..., 1:]; one as long is left alone (no broadcast error)
    shifted = torch.tensor([[5, 6, 7]])
    assert mask_padded_context(shifted, torch.tensor([[0, 1, 1]])).tolist() == [[5, 6, 7]]


def test_fields_named_like_input_ids_pad_with_the_pad_token():
    out = PaddingCollator(pad_token_id=7)([{"decoder_input_ids": [1, 2]}, {"decoder_input_ids": [3]}])
    assert out["decoder_input_ids"].tolist() == [[1, 2], [3, 7]]


def test_a_given_attention_mask_is_kept_whatever_the_field_order():
    items = [{"attention_mask": [1, 0], "input_ids": [5, 6]}, {"attention_mask": [1], "input_ids": [8]}]
    out = PaddingCollator()(items)
    assert out["attention_mask"].tolist() == [[1, 0], [1, 0]]
    assert list(out) == ["attention_mask", "input_ids"]


def test_an_integral_float_pad_value_keeps_an_integer_field_integer():
    out = PaddingCollator(pad_values={"x": 1.0})([{"x": [2, 3]}, {"x": [4]}])
    assert out["x"].dtype == torch.int64 and out["x"].tolist() == [[2, 3], [4, 1]]


def test_a_bool_field_padded_with_one_stays_bool():
    items = [{"m": torch.tensor([False, False])}, {"m": torch.tensor([False])}]
    out = PaddingCollator(pad_values={"m": 1})(items)
    assert out["m"].dtype == torch.bool and out["m"].tolist() == [[False, False], [False, True]]


def test_all_empty_sequences_pad_as_int64_not_float():
    out = PaddingCollator()([{"x": []}, {"x": []}])
    assert out["x"].dtype == torch.int64 and tuple(out["x"].shape) == (2, 0)


def test_float_labels_are_stacked_as_floats():
    out = PaddingCollator()([{"labels": 0.5}, {"labels": 1.5}])
    assert out["labels"].dtype == torch.float32 and out["labels"].tolist() == [0.5, 1.5]


def test_per_token_fields_longer_than_input_ids_are_refused():
    with pytest.raises(DataError, match=r"item 0: field 'attention_mask' has 3 values but 'input_ids' has 2"):
        PaddingCollator()([{"input_ids": [1, 2], "attention_mask": [1, 1, 1]}])
    with pytest.raises(DataError, match=r"item 1: field 'position_ids' has 1 values but 'input_ids' has 2"):
        PaddingCollator()([{"input_ids": [1], "position_ids": [0]}, {"input_ids": [1, 2], "position_ids": [0]}])


def test_mlm_masks_are_pinned_for_a_known_seed_epoch_and_sequence():
    """The masking is a documented pure function of (seed, epoch, tokens): pinned, so a resumed
    run (or another version) masks the same tokens the first run did."""
    from lightlike.data import LanguageModelingCollator

    c = LanguageModelingCollator(0, mlm=True, mlm_probability=0.5, mask_token_id=99, vocab_size=50, seed=3)
    out = c([list(range(1, 21))])
    assert out["input_ids"].tolist() == [[1, 2, 3, 99, 5, 99, 7, 8, 9, 10, 11, 12, 13, 99, 15, 16, 99, 18, 99, 20]]
    assert out["labels"].tolist() == [[-100, 2, -100, 4, -100, 6, -100, -100, -100, -100, -100, -100, -100, 14,
                                       -100, 16, 17, -100, 19, -100]]


def test_mlm_probability_zero_is_accepted_and_masks_nothing():
    from lightlike.data import LanguageModelingCollator

    c = LanguageModelingCollator(0, mlm=True, mlm_probability=0.0, mask_token_id=99, vocab_size=50)
    out = c([[1, 2, 3]])
    assert out["input_ids"].tolist() == [[1, 2, 3]] and out["labels"].tolist() == [[-100, -100, -100]]


def test_language_modeling_collator_pads_to_a_multiple():
    from lightlike.data import LanguageModelingCollator

    out = LanguageModelingCollator(0, pad_to_multiple_of=4)([[1, 2, 3, 4, 5]])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert out["labels"].tolist() == [[1, 2, 3, 4, 5, -100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]


def test_length_grouped_single_item():
    s = LengthGroupedSampler([5], 1, rank=0, world_size=1)
    assert list(s) == [0] and len(s) == 1


def test_length_grouped_refuses_float_lengths_and_zero_group_size():
    with pytest.raises(ValueError, match="1-D sequence of ints"):
        LengthGroupedSampler([1.5, 2.0], 1, rank=0, world_size=1)
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        LengthGroupedSampler([1, 2], 1, group_size=0, rank=0, world_size=1)


def test_every_nth():
    assert list(EveryNth("abcde", 0, 2)) == ["a", "c", "e"] and len(EveryNth("abcde", 0, 2)) == 3
    assert list(EveryNth("abcde", 1, 2)) == ["b", "d"] and len(EveryNth("abcde", 1, 2)) == 2


def test_length_grouped_exact_order_when_the_last_turn_is_redrawn():
    # seed 3: the last megabatch (lengths 9, 5 sorted) draws turn 0 and holds the longest item of
    # all, so the turn is redrawn in 1..len-1; the longest (index 5) then heads the epoch
    s = LengthGroupedSampler([3, 1, 2, 5, 4, 9], 1, group_size=4, seed=3, rank=0, world_size=1)
    assert list(s) == [5, 4, 0, 2, 3, 1]


def test_length_grouped_a_tie_with_an_earlier_longest_keeps_turn_zero():
    s = LengthGroupedSampler([5, 5, 1, 2, 3, 5, 4, 2], 1, group_size=4, seed=11, rank=0, world_size=1)
    assert list(s) == [1, 5, 3, 2, 7, 4, 6, 0]


def test_length_grouped_longest_first_puts_the_longest_item_first():
    lengths = [4, 8, 1, 7, 3, 2, 6, 5, 12, 9, 11, 10]
    for seed in range(4):
        s = LengthGroupedSampler(lengths, 2, group_size=4, seed=seed, rank=0, world_size=1)
        assert next(iter(s)) == 8
    off = LengthGroupedSampler(lengths, 2, group_size=4, seed=0, rank=0, world_size=1, longest_first=False)
    assert [lengths[i] for i in off][:4] == sorted([lengths[i] for i in off][:4], reverse=True)


class Net(nn.Module):
    def forward(self, input_ids, *, attention_mask=None):
        return input_ids


def test_remove_unused_keys_reads_forward_and_keeps_label_keys():
    batch = {"input_ids": 1, "attention_mask": 2, "text": 3, "labels": 4, "targets": 5, "idx": 6}
    assert remove_unused_keys(Net(), batch) == {"input_ids": 1, "attention_mask": 2, "labels": 4, "targets": 5}


def test_remove_unused_keys_refusals():
    from lightlike.module import TaskModule

    class T(TaskModule):
        def forward(self, batch):
            return batch

    with pytest.raises(DataError, match="a TaskModule's forward takes the whole batch"):
        remove_unused_keys(T(), {"x": 1})
    with pytest.raises(TypeError, match="batch_keys must be a collection of key names"):
        remove_unused_keys(SimpleNamespace(batch_keys="input_ids"), {"input_ids": 1})

    class Star(nn.Module):
        def forward(self, *args, **kwargs):
            return args

    with pytest.raises(DataError, match="names no parameters"):
        remove_unused_keys(Star(), {"x": 1})
    with pytest.raises(DataError, match="would drop every key of the batch"):
        remove_unused_keys(Net(), {"text": 1}, keep=())


def fake_worker(monkeypatch, num_workers, wid):
    import lightlike.data.iterable as it
    monkeypatch.setattr(it, "get_worker_info", lambda: SimpleNamespace(num_workers=num_workers, id=wid))


def test_sharded_iterable_shards_by_rank_times_workers_plus_worker(monkeypatch):
    fake_worker(monkeypatch, 2, 1)
    assert list(ShardedIterable(list(range(12)), rank=0, world_size=2)) == [1, 5, 9]
    assert list(ShardedIterable(list(range(12)), rank=1, world_size=2)) == [3, 7, 11]


def test_sharded_iterable_batches_counted_per_worker_shard():
    s = ShardedIterable(list(range(11)), rank=1, world_size=2)
    # shards of 4: rank 1's workers take positions 2,6,10 and 3,7
    assert s.batches(2, drop_last=False, workers=2) == 2 + 1
    assert s.batches(2, drop_last=True, workers=2) == 1 + 1
    assert s.batches(4, drop_last=False, workers=0) == 2  # no workers: one stream of 5 items (1,3,5,7,9)
    with pytest.raises(TypeError, match="not counted ahead"):
        ShardedIterable(list(range(4)), 0, 1, block=2).batches(2, False, 1)
    with pytest.raises(ValueError, match="block must be a positive int"):
        ShardedIterable(list(range(4)), 0, 1, block=0)

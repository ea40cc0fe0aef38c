"""Regression tests for two audited defects.

1. ``LengthGroupedSampler`` with its default ``mega=50`` sorted the whole of a small dataset as
   one megabatch: every epoch had the same length profile, and the tail that ``even=True`` leaves
   out on several processes was the dataset's shortest item in every epoch (never trained).
2. ``PaddingCollator`` did not take a list of numpy integers (``list(np.array([1, 2, 3]))``) for a
   sequence: unequal lengths raised a misleading "different shapes" error, equal lengths were
   stacked without ``attention_mask`` or label padding.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from test_data_utils import padding_waste

from lightlike.data import LanguageModelingCollator, LengthGroupedSampler, PaddingCollator
from lightlike.data.sampler import epoch_permutation


def small_lengths(n=101, seed=0):
    return torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rank_batches(lengths, epoch, rank, world_size=2, batch_size=4, **kw):
    s = LengthGroupedSampler(lengths, batch_size, rank=rank, world_size=world_size, seed=0, **kw)
    s.set_epoch(epoch)
    order = list(s)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ============================================================================================
# 1. LengthGroupedSampler: the default megabatch and the left-out tail
# ============================================================================================
def test_default_mega_is_capped_by_the_dataset_size_as_in_hf():
    lengths = small_lengths()
    s = LengthGroupedSampler(lengths, 4, rank=0, world_size=2)
    assert s.mega == 101 // (4 * 4 * 2) == 3 and s.group_size == 3 * 4 * 2  # was 50 * 4 * 2 = 400
    assert LengthGroupedSampler(lengths, 64, rank=0, world_size=2).group_size == 64 * 2  # at least 1 batch
    big = LengthGroupedSampler([1] * 100_000, 4, rank=0, world_size=2)
    assert big.mega == 50 and big.group_size == 400  # the cap of 50 still holds
    # what the caller passes is kept as it is
    assert LengthGroupedSampler(lengths, 4, mega=50, rank=0, world_size=2).group_size == 400
    assert LengthGroupedSampler(lengths, 4, group_size=300, rank=0, world_size=2).group_size == 300
    with pytest.raises(ValueError, match="mega"):
        LengthGroupedSampler(lengths, 4, mega=0, rank=0, world_size=1)


def test_small_dataset_epochs_differ():
    """The audit: with one megabatch over all 101 items, rank 0's batches had the same longest
    lengths (198, 187, 166, 154, ...) every epoch and 6 of its 13 batches were the same."""
    lengths = small_lengths()
    profiles = set()
    for epoch in range(4):
        profiles.add(tuple(max(lengths[i] for i in b) for b in rank_batches(lengths, epoch, rank=0)))
    assert len(profiles) == 4
    b0 = {frozenset(b) for b in rank_batches(lengths, 0, rank=0)}
    b1 = {frozenset(b) for b in rank_batches(lengths, 1, rank=0)}
    assert len(b0 & b1) <= 2


def left_out(lengths, epochs, world_size=2, **kw):
    """The items no rank takes in each epoch (even=True drops the tail of n % world_size)."""
    out = []
    for epoch in range(epochs):
        taken = set()
        for r in range(world_size):
            s = LengthGroupedSampler(lengths, 4, rank=r, world_size=world_size, seed=0, **kw)
            s.set_epoch(epoch)
            taken.update(s)
        out.append(set(range(len(lengths))) - taken)
    return out


@pytest.mark.parametrize("kw", [{}, {"mega": 50}], ids=["default", "one-megabatch"])
def test_left_out_tail_is_not_always_the_shortest_item(kw):
    """The audit: item 5, the only shortest one, was left out in all 20 epochs checked. Even with
    one megabatch over all the data (mega=50 passed), the left-out item changes with the epoch."""
    lengths = small_lengths()
    shortest = min(range(101), key=lambda i: lengths[i])
    drops = left_out(lengths, 20, **kw)
    assert all(len(d) == 1 for d in drops)
    dropped = [next(iter(d)) for d in drops]
    assert dropped.count(shortest) <= 3
    assert len(set(dropped)) >= 12
    assert sum(lengths[i] for i in dropped) / 20 > 2 * min(lengths)  # not the short ones


def test_left_out_item_is_uniform_over_the_items():
    """With one item left out an epoch, every item is as likely as any other to be the one."""
    lengths = small_lengths()
    s = LengthGroupedSampler(lengths, 4, mega=50, rank=0, world_size=2, seed=0)
    counts = Counter(int(s.global_order(epoch)[-1]) for epoch in range(3000))
    assert len(counts) == 101  # every item, the longest and the shortest included
    assert max(counts.values()) < 3 * 3000 / 101


def test_order_is_a_pure_function_of_seed_epoch_n_and_group_size():
    lengths = small_lengths(n=203)
    a = LengthGroupedSampler(lengths, 8, group_size=64, seed=3, rank=0, world_size=1)
    b = LengthGroupedSampler(lengths, 4, group_size=64, seed=3, rank=1, world_size=2, even=False)
    c = LengthGroupedSampler(lengths, 2, group_size=64, seed=3, rank=2, world_size=4)
    for epoch in range(3):
        assert torch.equal(a.global_order(epoch), b.global_order(epoch))
        assert torch.equal(a.global_order(epoch), c.global_order(epoch))
    # the megabatches are the default sampler's shuffled order cut into groups of 64
    order = a.global_order(1)
    perm = epoch_permutation(203, 3, 1, True)
    for k in range(0, 203, 64):
        assert set(order[k:k + 64].tolist()) == set(perm[k:k + 64].tolist())
    # all but the last megabatch sorted longest first; the last: two sorted runs
    for epoch in range(5):
        o = LengthGroupedSampler(lengths, 8, group_size=64, seed=3, rank=0, world_size=1,
                                 longest_first=False).global_order(epoch)
        for k in range(0, 192, 64):
            ls = [lengths[i] for i in o[k:k + 64]]
            assert ls == sorted(ls, reverse=True)
        tail = [lengths[i] for i in o[192:]]
        assert any(tail[:t] == sorted(tail[:t], reverse=True) and tail[t:] == sorted(tail[t:])
                   for t in range(len(tail) + 1))
        assert sorted(o.tolist()) == list(range(203))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_cover_the_epoch_once_and_resume_on_the_right_sample(world_size):
    lengths = small_lengths(n=203)
    bs = 4
    shares = [list(LengthGroupedSampler(lengths, bs, rank=r, world_size=world_size, seed=1))
              for r in range(world_size)]
    assert len({len(s) for s in shares}) == 1  # even: every rank takes as many steps
    union = [i for s in shares for i in s]
    assert len(union) == len(set(union)) == 203 - 203 % world_size
    full = LengthGroupedSampler(lengths, bs, rank=0, world_size=world_size, seed=1).global_order()
    assert set(full[203 - 203 % world_size:].tolist()) == set(range(203)) - set(union)  # the tail
    for start in (0, bs * world_size, 5 * bs * world_size, 203 - 203 % world_size):
        for r in range(world_size):
            s = LengthGroupedSampler(lengths, bs, rank=r, world_size=world_size, seed=1)
            s.set_epoch(0, start)
            assert list(s) == shares[r][start // world_size:]


def test_resume_on_another_world_size_with_the_first_group_size_serves_each_item_once():
    lengths = small_lengths(n=203)
    first = LengthGroupedSampler(lengths, 4, rank=0, world_size=2, seed=1)
    g = first.group_size
    for start in (8 * 4, 8 * 20):  # global samples the 2-process run consumed (the last one: in the last megabatch)
        consumed = first.global_order()[:start].tolist()
        rest = []
        for r in range(3):
            s = LengthGroupedSampler(lengths, 4, group_size=g, rank=r, world_size=3, seed=1)
            s.set_epoch(0, start)
            rest.extend(s)
        assert not set(consumed) & set(rest) and len(set(rest)) == len(rest)
        assert len(consumed) + len(rest) == 203 - (203 - start) % 3


def test_grouping_still_saves_padding():
    lengths = small_lengths(n=2000, seed=2)
    for epoch in range(3):
        for r in range(2):
            batches = rank_batches(lengths, epoch, rank=r, batch_size=8)
            order = [i for b in batches for i in b]
            random = torch.randperm(2000, generator=torch.Generator().manual_seed(epoch))[:len(order)].tolist()
            assert padding_waste(order, lengths, 8) < 0.25 * padding_waste(random, lengths, 8)
    s = LengthGroupedSampler(lengths, 8, rank=0, world_size=1, seed=0)
    assert lengths[int(s.global_order()[0])] == max(lengths)  # longest first still


@pytest.mark.parametrize(("n", "bs", "world_size"), [(40, 2, 3), (300, 8, 4), (2000, 8, 8)])
def test_each_rank_takes_a_contiguous_run_of_each_global_batch(n, bs, world_size):
    """Dealt round-robin, rank r's batch held sorted items r, r+W, r+2W, ... of the global batch,
    so its longest item was among the W longest: on 3 ranks with one global batch per megabatch
    it padded more than a random order (0.39 against 0.29), and at 2000 items on 8 ranks 0.145
    against 0.019 for contiguous runs. Each rank now takes the r-th run of batch_size positions
    of each global batch (the last, partial one round-robin, so the shares stay as long)."""
    lengths = small_lengths(n=n, seed=2)
    span = bs * world_size
    waste = {"contiguous": 0, "round-robin": 0, "random": 0}
    for epoch in range(10):
        order = LengthGroupedSampler(lengths, bs, rank=0, world_size=world_size, seed=0).global_order(epoch)
        end = n - n % world_size
        for r in range(world_size):
            batches = rank_batches(lengths, epoch, rank=r, world_size=world_size, batch_size=bs)
            whole = end // span
            assert batches[:whole] == [order[k * span + r * bs: k * span + (r + 1) * bs].tolist() for k in range(whole)]
            mine = [i for b in batches for i in b]
            waste["contiguous"] += padding_waste(mine, lengths, bs)
            waste["round-robin"] += padding_waste(order[r:end:world_size].tolist(), lengths, bs)
            random = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))[:len(mine)].tolist()
            waste["random"] += padding_waste(random, lengths, bs)
    assert waste["contiguous"] < 0.6 * waste["round-robin"] and waste["contiguous"] < 0.6 * waste["random"], waste


def test_a_dataloader_batch_size_other_than_the_samplers_is_refused(tmp_path):
    """Each rank's DataLoader batch must be the sampler's run: with batch_size 2 over a sampler of
    4, a mid-epoch resume served items twice and skipped others (nothing said so)."""
    from helpers import Classifier, DictDataset

    import lightlike as ll
    from lightlike.errors import DataError

    data = DictDataset(n=16)
    sampler = LengthGroupedSampler([1 + i % 5 for i in range(16)], 4, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    with pytest.raises(DataError, match="batch_size=2 differs from its LengthGroupedSampler's batch_size=4"):
        ll.Fitter(max_steps=2, output_dir=str(tmp_path), loggers=[]).fit(Classifier(), loader)


def test_longest_first_in_one_megabatch_keeps_the_first_batch_homogeneous():
    """One megabatch over all the data: it runs longest first down to the turn, so the first
    batch is still the longest items (unless the turn falls inside it)."""
    lengths = small_lengths()
    top8 = sorted(lengths, reverse=True)[:8]
    firsts = []
    for epoch in range(10):
        o = LengthGroupedSampler(lengths, 8, mega=50, rank=0, world_size=1, seed=0).global_order(epoch)
        assert lengths[int(o[0])] == max(lengths)
        firsts.append(sorted((lengths[i] for i in o[:8]), reverse=True) == top8)
    assert sum(firsts) >= 8


# ============================================================================================
# 2. PaddingCollator / LanguageModelingCollator: sequences of numpy numbers
# ============================================================================================
def test_lists_of_numpy_ints_of_unequal_lengths_are_padded():
    batch = PaddingCollator(pad_token_id=9)([
        {"input_ids": list(np.array([1, 2, 3])), "labels": list(np.array([1, 2, 3]))},
        {"input_ids": list(np.array([4])), "labels": list(np.array([4]))},
    ])
    assert list(batch) == ["input_ids", "attention_mask", "labels"]
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]


def test_lists_of_numpy_ints_of_equal_lengths_give_the_same_keys_as_python_ints():
    def items(convert):
        return [{"input_ids": convert([1, 2]), "labels": convert([1, 2]), "y": 1},
                {"input_ids": convert([3, 4]), "labels": convert([3, 4]), "y": 0}]

    collate = PaddingCollator()
    ref = collate(items(list))
    got = collate(items(lambda x: list(np.array(x))))
    assert list(got) == list(ref) == ["input_ids", "attention_mask", "labels", "y"]
    for k in ref:
        assert torch.equal(got[k], ref[k])
    # and batch to batch: an unequal batch has the same keys
    assert list(collate([{"input_ids": list(np.array([1])), "labels": list(np.array([1])), "y": 1},
                         {"input_ids": list(np.array([3, 4])), "labels": list(np.array([3, 4])), "y": 0}])) == list(ref)


@pytest.mark.parametrize("values", [
    [np.int32(1), np.int64(2)],
    [np.float32(0.5), np.float64(1.5)],
    [np.bool_(True), np.bool_(False)],
    [torch.tensor(1), torch.tensor(2)],
    (np.int64(1), np.int64(2)),
], ids=["np-int", "np-float", "np-bool", "0d-tensor", "tuple"])
def test_other_numpy_and_zero_d_scalars_make_a_sequence(values):
    batch = PaddingCollator()([{"input_ids": [1, 2], "feat": values}, {"input_ids": [3], "feat": values[:1]}])
    assert batch["feat"].shape == (2, 2)
    assert batch["feat"][0].tolist() == [v.item() for v in values]


def test_lists_of_numpy_strings_are_still_passed_on():
    words = [list(np.array(["a", "b"])), list(np.array(["c"]))]
    batch = PaddingCollator()([{"input_ids": [1, 2], "tags": words[0]}, {"input_ids": [3], "tags": words[1]}])
    assert batch["tags"] == words


def test_language_modeling_collator_with_numpy_int_fields():
    ids = [list(np.array([5, 6, 7])), list(np.array([8]))]
    causal = LanguageModelingCollator(pad_token_id=0)
    batch = causal([{"input_ids": ids[0], "labels": list(np.array([-100, 6, 7])), "attention_mask": list(np.array([1, 1, 1]))},
                    {"input_ids": ids[1], "labels": list(np.array([8])), "attention_mask": list(np.array([1]))}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    mlm = LanguageModelingCollator(pad_token_id=0, mlm=True, mask_token_id=3, vocab_size=50, mlm_probability=1.0,
                                   mask_replace_prob=1.0, random_replace_prob=0.0)
    batch = mlm([{"input_ids": ids[0], "special_tokens_mask": list(np.array([1, 0, 0])), "token_type_ids": list(np.array([0, 0, 1]))},
                 {"input_ids": ids[1], "special_tokens_mask": list(np.array([0])), "token_type_ids": list(np.array([1]))}])
    assert batch["input_ids"].tolist() == [[5, 3, 3], [3, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_longest_first_leaves_out_no_item_twice_as_often():
    """One megabatch, one item left out an epoch: when the turn made the order end on the
    longest item, longest_first swapped it with the first one, the shortest, which was then
    left out twice as often as any other (22 % against 11 % over 9 items)."""
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    s = LengthGroupedSampler(lengths, 1, mega=50, rank=0, world_size=2, seed=0)
    counts = Counter(int(s.global_order(epoch)[-1]) for epoch in range(4000))
    assert 8 not in counts  # the longest is always in the first batch
    assert max(counts.values()) / 4000 < 0.16 and min(counts.values()) / 4000 > 0.09  # 1/8 each


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_integer_labels_come_back_int64_padded_with_minus_100(dtype):
    """Labels kept their items' dtype: in uint8 the -100 padding became 156 (a class that
    cross_entropy then trained on), in uint16 65436 (out of range), and int16/int32 labels were
    refused by cross_entropy. As HF's collators give: int64, -100 on padding."""
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([1, 2, 3], dtype=dtype)},
             {"input_ids": torch.tensor([8]), "labels": torch.tensor([4], dtype=dtype)}]
    out = PaddingCollator()(items)
    assert out["labels"].dtype == torch.int64 and out["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert out["input_ids"].dtype == torch.int64
    logits = torch.zeros(2, 3, 200)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), out["labels"].flatten())  # padding ignored
    assert loss.item() == pytest.approx(np.log(200))
    own = LanguageModelingCollator(pad_token_id=0)([{"input_ids": np.array([5, 6], dtype=np.uint16),
                                                     "labels": np.array([-1, 6], dtype=np.int16)},
                                                    {"input_ids": np.array([7], dtype=np.uint16),
                                                     "labels": np.array([7], dtype=np.int16)}])
    assert own["labels"].dtype == torch.int64 and own["labels"].tolist() == [[-1, 6], [7, -100]]
    small = PaddingCollator(pad_values={"ids": 300})([{"ids": np.array([1, 2], dtype=np.uint8)},
                                                      {"ids": np.array([3], dtype=np.uint8)}])
    assert small["ids"].tolist() == [[1, 2], [3, 300]]  # a pad value the dtype cannot hold widens it


def test_whether_a_field_is_padded_does_not_depend_on_the_first_item():
    """A list of words is passed on as it is, but an empty list first made the batch a padded
    field (DataError on the words); the first non-empty value decides."""
    items = [{"input_ids": [1, 2], "tags": []}, {"input_ids": [3], "tags": ["def", "x"]}]
    for batch in (items, items[::-1]):
        out = PaddingCollator()(batch)
        assert sorted(map(tuple, out["tags"])) == [(), ("def", "x")]


def test_bool_and_unpadded_integer_labels_come_back_int64():
    """Bool labels padded with -100 came out True; a label of one number per item kept int32,
    which cross_entropy refuses (HF's collators give int64 for both)."""
    items = [{"input_ids": [1, 2], "labels": torch.tensor([True, False]), "label": np.int32(2),
              "flags": torch.tensor([True])},
             {"input_ids": [3], "labels": torch.tensor([True]), "label": np.int32(0), "flags": torch.tensor([False])}]
    out = PaddingCollator(pad_values={"flags": -1}, keys=["input_ids", "labels", "flags"])(items)
    assert out["labels"].dtype == torch.int64 and out["labels"].tolist() == [[1, 0], [1, -100]]
    assert out["label"].dtype == torch.int64 and out["label"].tolist() == [2, 0]
    assert out["flags"].tolist() == [[1], [0]] and out["flags"].dtype == torch.int64  # -1 does not fit bool
    assert PaddingCollator(keys=["m"])([{"m": torch.tensor([True, True])}, {"m": torch.tensor([True])}])["m"].dtype \
        == torch.bool  # a pad value of 0 fits: bool stays bool
    half = PaddingCollator(pad_values={"w": 0.5})([{"w": [1, 2]}, {"w": [3]}])["w"]  # 0.5 was padded as 0
    assert half.dtype == torch.float32 and half.tolist() == [[1.0, 2.0], [3.0, 0.5]]
    mask = PaddingCollator(pad_values={"m": 0.5})([{"m": torch.tensor([True, False])}, {"m": torch.tensor([True])}])
    assert mask["m"].tolist() == [[1.0, 0.0], [1.0, 0.5]]  # a bool field too (0.5 was padded as 0)

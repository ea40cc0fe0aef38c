"""Data utilities: padding and language-modelling collators, exact accumulation over tokens,
the length-grouped sampler, and removal of unused batch keys. References are hand-written
tensors and plain-torch computations, never the code under test."""

from __future__ import annotations

import logging
import math
import pickle

import pytest
import torch
from helpers import StopAt, flat_grads, flat_params
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import lightlike as ll
from lightlike.data import (
    LanguageModelingCollator,
    LengthGroupedSampler,
    PaddingCollator,
    count_label_tokens,
    remove_unused_keys,
)
from lightlike.data.sampler import ResumableSampler
from lightlike.errors import DataError

T = torch.tensor


# ============================================================================================
# PaddingCollator
# ============================================================================================
def test_padding_right_by_hand():
    items = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "y": 1, "text": "abc"},
        {"input_ids": T([8]), "labels": T([8]), "y": 0, "text": "d"},
        {"input_ids": [9, 10], "labels": [-100, 10], "y": 2, "text": "ef"},
    ]
    b = PaddingCollator(pad_token_id=3)(items)
    assert list(b) == ["input_ids", "attention_mask", "labels", "y", "text"]
    torch.testing.assert_close(b["input_ids"], T([[5, 6, 7], [8, 3, 3], [9, 10, 3]]))
    torch.testing.assert_close(b["attention_mask"], T([[1, 1, 1], [1, 0, 0], [1, 1, 0]]))
    torch.testing.assert_close(b["labels"], T([[5, 6, 7], [8, -100, -100], [-100, 10, -100]]))
    torch.testing.assert_close(b["y"], T([1, 0, 2]))
    assert b["text"] == ["abc", "d", "ef"]
    # -100 is what cross-entropy ignores: the padded loss is the mean over the 5 real labels
    logits = torch.randn(3, 3, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    padded = F.cross_entropy(logits.reshape(-1, 12), b["labels"].reshape(-1))
    real = [(0, 0, 5), (0, 1, 6), (0, 2, 7), (1, 0, 8), (2, 1, 10)]
    by_hand = sum(-torch.log_softmax(logits[i, t], -1)[c] for i, t, c in real) / len(real)
    torch.testing.assert_close(padded, by_hand, rtol=1e-12, atol=0)


def test_padding_left_multiple_and_own_lengths():
    items = [{"input_ids": [1, 2, 3, 4, 5], "labels": [7]}, {"input_ids": [6], "labels": [8, 9, 10]}]
    b = PaddingCollator(pad_token_id=0, padding_side="left", pad_to_multiple_of=4)(items)
    torch.testing.assert_close(b["input_ids"], T([[0, 0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0, 0, 6]]))
    torch.testing.assert_close(b["attention_mask"], T([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]]))
    # sequence-to-sequence labels are padded to their own longest (3 -> 4), not to input_ids'
    torch.testing.assert_close(b["labels"], T([[-100, -100, -100, 7], [-100, 8, 9, 10]]))


@pytest.mark.parametrize(("lengths", "multiple", "width"), [((8, 5), 8, 8), ((9, 5), 8, 16), ((3, 1), 4, 4),
                                                         ((4, 4), 4, 4), ((5, 2), 1, 5), ((5, 2), None, 5)])
def test_pad_to_multiple_of_rounds_the_longest_up(lengths, multiple, width):
    """The width is the smallest multiple at or above the longest: a longest that is already a
    multiple stays as it is."""
    items = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    b = PaddingCollator(pad_token_id=0, pad_to_multiple_of=multiple)(items)
    assert b["input_ids"].shape == (2, width) and b["attention_mask"].shape == (2, width)
    assert b["attention_mask"].sum(1).tolist() == list(lengths)


def test_padding_given_mask_keys_and_pad_values():
    items = [{"input_ids": [1, 2], "attention_mask": [1, 0], "special_tokens_mask": [1, 0], "x": [0.5, 1.5]},
             {"input_ids": [3], "attention_mask": [1], "special_tokens_mask": [1], "x": [2.5, 3.5]}]
    b = PaddingCollator(pad_token_id=9, pad_values={"input_ids": 4})(items)
    torch.testing.assert_close(b["input_ids"], T([[1, 2], [3, 4]]))
    torch.testing.assert_close(b["attention_mask"], T([[1, 0], [1, 0]]))  # the item's own mask, padded with 0
    torch.testing.assert_close(b["special_tokens_mask"], T([[1, 0], [1, 1]]))  # padding is special
    torch.testing.assert_close(b["x"], T([[0.5, 1.5], [2.5, 3.5]]))
    # keys=...: only the named fields are padded; a fixed-size feature vector is stacked
    b = PaddingCollator(keys=["input_ids"])([{"input_ids": [1], "x": T([1.0, 2.0])}, {"input_ids": [], "x": T([3.0, 4.0])}])
    torch.testing.assert_close(b["input_ids"], T([[1], [0]]))  # an empty item stays int64
    torch.testing.assert_close(b["x"], T([[1.0, 2.0], [3.0, 4.0]]))


@pytest.mark.parametrize("items,words", [
    ([{"input_ids": [1]}, {"labels": [1]}], ["item 1", "'input_ids'"]),
    ([{"input_ids": [1]}, {"input_ids": [1], "extra": 1}], ["item 1", "'extra'"]),
    ([{"input_ids": [1]}, {"input_ids": [[1, 2], [3, 4]]}], ["item 1", "'input_ids'", "2-D"]),
    ([{"input_ids": [1]}, {"input_ids": [[1, 2], [3]]}], ["item 1", "'input_ids'"]),
    ([{"input_ids": [1]}, {"input_ids": "hello"}], ["item 1", "'input_ids'", "str"]),
    ([{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [1], "attention_mask": [1, 1]}],
     ["item 1", "'attention_mask'", "'input_ids'"]),
    ([{"input_ids": [1]}, [1, 2]], ["item 1", "list"]),
    ([{"input_ids": [1], "img": torch.zeros(2, 2)}, {"input_ids": [1], "img": torch.zeros(3, 2)}], ["'img'", "keys="]),
    ([], ["empty"]),
])
def test_padding_errors_name_item_and_field(items, words):
    with pytest.raises(DataError) as e:
        PaddingCollator()(items)
    for w in words:
        assert w in str(e.value)


def test_padding_bad_arguments():
    with pytest.raises(ValueError, match="padding_side"):
        PaddingCollator(padding_side="middle")
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        PaddingCollator(pad_to_multiple_of=0)
    with pytest.raises(DataError, match="'labels'"):
        PaddingCollator(keys=["labels"])([{"input_ids": [1]}])


# ============================================================================================
# LanguageModelingCollator
# ============================================================================================
def test_label_fields_pad_with_the_ignore_index_and_empty_sequences_pad():
    """'label' and 'label_ids' hold per-token labels as 'labels' does (HF's token classification
    collator pads 'label' with -100): padded with 0 they read as class 0. And an empty sequence
    ([], which torch makes a float tensor) is padded, not refused, by both collators."""
    b = PaddingCollator(pad_token_id=0)([{"input_ids": [1, 2, 3], "label": [1, 2, 1], "label_ids": [4, 4, 4]},
                                         {"input_ids": [5], "label": [2], "label_ids": [3]}])
    torch.testing.assert_close(b["label"], T([[1, 2, 1], [2, -100, -100]]))
    torch.testing.assert_close(b["label_ids"], T([[4, 4, 4], [3, -100, -100]]))
    for mlm in (False, True):
        b = LanguageModelingCollator(pad_token_id=0, mlm=mlm, mask_token_id=9, vocab_size=10, seed=0)([[5, 6], []])
        assert b["input_ids"].dtype == torch.long and b["input_ids"][1].tolist() == [0, 0]
        assert b["labels"][1].tolist() == [-100, -100]


def test_causal_labels_by_hand():
    eos = pad = 2  # GPT-2 style: the pad token is the EOS token
    b = LanguageModelingCollator(pad_token_id=pad)([[5, 6, eos], {"input_ids": T([7])}, [8, 9]])
    torch.testing.assert_close(b["input_ids"], T([[5, 6, 2], [7, 2, 2], [8, 9, 2]]))
    torch.testing.assert_close(b["attention_mask"], T([[1, 1, 1], [1, 0, 0], [1, 1, 0]]))
    # the real EOS keeps its label; padding (told by the mask, not the value) gets -100; unshifted
    torch.testing.assert_close(b["labels"], T([[5, 6, 2], [7, -100, -100], [8, 9, -100]]))
    # an item's own labels (a masked prompt) and attention mask are kept, then padded
    col = LanguageModelingCollator(pad_token_id=0, padding_side="left")
    b = col([{"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [7], "labels": [7]}])
    torch.testing.assert_close(b["labels"], T([[-100, 5, 6], [-100, -100, 7]]))
    b = col([{"input_ids": [4, 5, 6], "attention_mask": [1, 1, 1]}, {"input_ids": [7, 8], "attention_mask": [0, 1]}])
    torch.testing.assert_close(b["labels"], T([[4, 5, 6], [-100, -100, 8]]))
    torch.testing.assert_close(b["attention_mask"], T([[1, 1, 1], [0, 0, 1]]))


def test_count_label_tokens_by_hand():
    labels = T([[5, 6, 2], [7, -100, -100], [-100, 9, -100]])
    n = count_label_tokens({"labels": labels})
    assert isinstance(n, torch.Tensor) and n.item() == 5
    assert count_label_tokens(labels, shift=True).item() == 3  # first column is never a target
    assert count_label_tokens({"tags": T([[0, 3, 3]])}, ignore_index=3, key="tags").item() == 1
    with pytest.raises(DataError, match="tensor"):
        count_label_tokens({"labels": [1, 2]})


def mlm(**kw):
    args = dict(pad_token_id=0, mlm=True, mask_token_id=1, vocab_size=1000, special_token_ids=(2, 3), seed=5)
    return LanguageModelingCollator(**{**args, **kw})


def test_mlm_never_masks_special_or_padding():
    # probability 1 and always [MASK]: every eligible token is selected, nothing else is
    c = mlm(mlm_probability=1.0, mask_replace_prob=1.0, random_replace_prob=0.0)
    b = c([{"input_ids": [2, 10, 0, 11, 3], "special_tokens_mask": [0, 0, 0, 1, 0]},
           {"input_ids": [2, 12, 3], "special_tokens_mask": [1, 0, 1]}])
    assert "special_tokens_mask" not in b
    torch.testing.assert_close(b["input_ids"], T([[2, 1, 0, 11, 3], [2, 1, 3, 0, 0]]))
    torch.testing.assert_close(b["labels"], T([[-100, 10, -100, -100, -100], [-100, 12, -100, -100, -100]]))
    torch.testing.assert_close(b["attention_mask"], T([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))


def test_mlm_80_10_10():
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(4, 1000, (2000, 100), generator=g)  # no special tokens: all eligible
    b = mlm()(list(seqs))
    inputs, labels = b["input_ids"], b["labels"]
    selected = labels != -100
    total, n_sel = seqs.numel(), int(selected.sum())
    assert abs(n_sel / total - 0.15) < 5 * math.sqrt(0.15 * 0.85 / total)
    assert torch.equal(labels[selected], seqs[selected])  # labels: the original tokens
    assert torch.equal(inputs[~selected], seqs[~selected])  # unselected tokens untouched
    masked = inputs[selected] == 1
    same = inputs[selected] == seqs[selected]
    other = ~masked & ~same
    tol = 5 * math.sqrt(0.25 / n_sel)
    assert abs(float(masked.float().mean()) - 0.8) < tol
    assert abs(float(other.float().mean()) - 0.1 * (1 - 1 / 1000)) < tol  # random, unless it hits the original
    assert abs(float(same.float().mean()) - (0.1 + 0.1 / 1000)) < tol
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 1000
    with pytest.raises(ValueError, match="mask_token_id"):
        LanguageModelingCollator(0, mlm=True)
    with pytest.raises(DataError, match="labels"):
        mlm()([{"input_ids": [5], "labels": [5]}])


def rows(batch, lengths):
    return [(batch["input_ids"][i, :n].tolist(), batch["labels"][i, :n].tolist()) for i, n in enumerate(lengths)]


def test_mlm_masks_are_a_function_of_seed_epoch_and_tokens():
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(4, 1000, (n,), generator=g).tolist() for n in (40, 25, 33))
    col = mlm(mlm_probability=0.5)
    ab, ca = rows(col([a, b]), [40, 25]), rows(col([c, a]), [33, 40])
    assert ab[0] == ca[1]  # the same sequence, another batch, position and padding: same mask
    assert rows(mlm(mlm_probability=0.5, seed=torch.Generator().manual_seed(5))([a]), [40]) == ab[:1]
    assert rows(mlm(mlm_probability=0.5, seed=6)([a]), [40]) != ab[:1]
    col.set_epoch(1)
    assert rows(col([a]), [40]) != ab[:1]  # a new epoch masks anew (dynamic masking)


def test_mlm_epoch_from_the_epoch_source():
    """With ``epoch_source`` the masks follow its ``epoch`` (read at each call) and equal those of
    a collator told the same epoch by ``set_epoch``; its own ``set_epoch`` is then ignored."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(4, 1000, (n,), generator=g).tolist() for n in (40, 25)]
    source = SimpleNamespace(epoch=0)
    col = mlm(mlm_probability=0.5, epoch_source=source)
    plain = mlm(mlm_probability=0.5)
    by_epoch = {}
    for epoch in (0, 1, 3):
        source.epoch = epoch
        plain.set_epoch(epoch)
        by_epoch[epoch] = rows(col(seqs), [40, 25])
        assert by_epoch[epoch] == rows(plain(seqs), [40, 25])
        col.set_epoch(7)  # ignored: the source says
        assert rows(col(seqs), [40, 25]) == by_epoch[epoch]
    assert by_epoch[0] != by_epoch[1] != by_epoch[3] != by_epoch[0]


def test_mlm_replace_probabilities_must_sum_to_at_most_one():
    for mask_p, random_p in ((0.6, 0.5), (1.0, 0.01), (-0.1, 0.1), (0.5, -0.1)):
        with pytest.raises(ValueError, match="sum to at most 1"):
            mlm(mask_replace_prob=mask_p, random_replace_prob=random_p)
    c = mlm(mlm_probability=1.0, mask_replace_prob=0.5, random_replace_prob=0.5)  # exactly 1: no token kept
    seqs = torch.randint(4, 1000, (50, 20), generator=torch.Generator().manual_seed(0))
    out = c(list(seqs))["input_ids"]
    assert 0.4 < float((out == 1).float().mean()) < 0.6
    assert float((out == seqs).float().mean()) < 0.01  # kept only where a random token hit the original


class Tokens(Dataset):
    def __init__(self, n=24, seed=0, vocab=50):
        g = torch.Generator().manual_seed(seed)
        self.seqs = [torch.randint(4, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g)
                     for _ in range(n)]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return {"input_ids": self.seqs[i], "idx": i}


def batches(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def assert_same_batches(x, y):
    assert len(x) == len(y)
    for p, q in zip(x, y, strict=True):
        assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)


def test_mlm_same_with_workers_and_after_resume():
    data = Tokens()

    def loader(workers, epoch, start=0):
        sampler = ResumableSampler(len(data), seed=1)
        sampler.set_epoch(epoch, start)
        col = mlm(vocab_size=50, mlm_probability=0.3, epoch_source=sampler)
        return DataLoader(data, batch_size=3, sampler=sampler, collate_fn=col, num_workers=workers)

    full = batches(loader(0, epoch=1))
    assert_same_batches(batches(loader(2, epoch=1)), full)  # workers: same batches
    # resume 3 samples (one batch) in: the tail, though every batch now lands on another worker
    assert_same_batches(batches(loader(2, epoch=1, start=3)), full[1:])
    assert_same_batches(batches(loader(0, epoch=1, start=12)), full[4:])
    other = batches(loader(0, epoch=2))  # the sampler's epoch reaches the masks
    by_idx = {int(i): row for b in other for i, row in zip(b["idx"], b["labels"], strict=True)}
    assert any(not torch.equal(by_idx[int(i)], row) for b in full for i, row in zip(b["idx"], b["labels"], strict=True))


# ============================================================================================
# exact accumulation over tokens, through the Fitter
# ============================================================================================
class TinyCausalLM(ll.TaskModule):
    """Embedding, causal prefix mean, linear head: position t sees tokens 0..t only."""

    def __init__(self, vocab=12, dim=6, count_tokens=True):
        super().__init__()
        self.emb, self.head, self.count_tokens = nn.Embedding(vocab, dim), nn.Linear(dim, vocab), count_tokens

    def forward(self, batch):
        e = self.emb(batch["input_ids"])
        steps = torch.arange(1, e.shape[1] + 1, dtype=e.dtype).view(1, -1, 1)
        return self.head(torch.tanh(e.cumsum(1) / steps))

    def loss(self, logits, batch):  # mean over the real next-token targets of this micro-batch
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))

    def num_items(self, batch):
        return count_label_tokens(batch, shift=True) if self.count_tokens else super().num_items(batch)


class GradRecorder(ll.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.grads.append(flat_grads(fitter.module).clone())


def token_reference_grad(data, indices):
    """Plain torch: each sequence alone (no padding), the sum of its next-token losses, divided
    by the number of targets of the whole window."""
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    total, count = 0.0, 0
    for i in indices:
        ids = data.seqs[i]
        logits = model({"input_ids": ids[None]})[0]
        total = total + F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
        count += len(ids) - 1
    (total / count).backward()
    return flat_grads(model)


def fitted_token_grads(tmp_path, data, count_tokens):
    torch.manual_seed(0)
    rec = GradRecorder()
    loader = DataLoader(data, batch_size=2, collate_fn=LanguageModelingCollator(pad_token_id=0))
    ll.Fitter(max_steps=2, grad_accum_steps=3, learning_rate=0.0, output_dir=str(tmp_path / str(count_tokens)),
              loggers=[], model_summary=False, callbacks=[rec], accelerator="cpu",
              ).fit(TinyCausalLM(count_tokens=count_tokens).double(), loader)
    return rec.grads


def test_accumulation_exact_over_tokens(tmp_path):
    data = Tokens(n=12, vocab=12)
    counts = [len(s) - 1 for s in data.seqs]
    assert len({counts[i] + counts[i + 1] for i in range(0, 12, 2)}) > 1  # micro-batches differ in tokens
    grads = fitted_token_grads(tmp_path, data, count_tokens=True)
    assert len(grads) == 2
    for step, indices in enumerate([range(0, 6), range(6, 12)]):
        torch.testing.assert_close(grads[step], token_reference_grad(data, indices), rtol=1e-12, atol=1e-14)
    # the guard: counting sequences instead of tokens gives another gradient
    naive = fitted_token_grads(tmp_path, data, count_tokens=False)
    assert not torch.allclose(naive[0], token_reference_grad(data, range(6)), rtol=1e-6)


# ============================================================================================
# LengthGroupedSampler
# ============================================================================================
def lengths_of(n=203, seed=0):
    return torch.randint(1, 513, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def padding_waste(order, lengths, batch_size):
    waste = 0
    for s in range(0, len(order), batch_size):
        b = [lengths[i] for i in order[s:s + batch_size]]
        waste += max(b) * len(b) - sum(b)
    return waste


def test_length_grouped_every_index_once_and_homogeneous():
    lengths = lengths_of()
    orders = []
    for epoch in range(3):
        s = LengthGroupedSampler(lengths, batch_size=8, mega=8, seed=3)
        s.set_epoch(epoch)
        order = list(s)
        assert sorted(order) == list(range(203)) and len(s) == 203
        orders.append(order)
        random = torch.randperm(203, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert padding_waste(order, lengths, 8) < 0.3 * padding_waste(random, lengths, 8)
    assert orders[0] != orders[1] != orders[2]  # shuffled anew every epoch
    assert lengths[orders[0][0]] == max(lengths)  # longest first: an OOM shows on step 1
    unshuffled = list(LengthGroupedSampler(lengths, 8, mega=4, shuffle=False, longest_first=False))
    expected = sum((sorted(range(s, min(s + 32, 203)), key=lambda i: -lengths[i]) for s in range(0, 203, 32)), [])
    assert unshuffled == expected  # by hand: megabatches of 4*8 in order, each sorted longest first


@pytest.mark.parametrize("start", [0, 1, 8, 37, 202, 203])
def test_length_grouped_resume_is_the_tail(start):
    lengths = lengths_of()
    full = list(LengthGroupedSampler(lengths, 8, mega=4, seed=3))
    s = LengthGroupedSampler(lengths, 8, mega=4, seed=3)
    s.set_epoch(0, start)
    assert list(s) == full[start:] and len(s) == 203 - start


def test_length_grouped_two_ranks_cover_the_epoch_once():
    lengths = lengths_of(n=200)
    one = list(LengthGroupedSampler(lengths, 8, mega=8, seed=3, world_size=1))
    ranks = [LengthGroupedSampler(lengths, 4, mega=8, seed=3, rank=r, world_size=2) for r in range(2)]
    shares = [list(r) for r in ranks]
    assert len(shares[0]) == len(shares[1]) == 100
    assert sorted(shares[0] + shares[1]) == list(range(200))
    # per-rank batches of 4 are the halves of the 1-process batches of 8 (rank 0 the first)
    joined = [i for k in range(25) for share in shares for i in share[4 * k: 4 * k + 4]]
    assert joined == one
    for share in shares:
        assert padding_waste(share, lengths, 4) < 0.3 * padding_waste(list(range(100)), lengths, 4)
    # resuming 40 global samples in: each rank continues its own share 20 samples in
    for r, share in zip(ranks, shares, strict=True):
        r.set_epoch(0, 40)
        assert list(r) == share[20:]
    odd = [list(LengthGroupedSampler(lengths_of(n=201), 4, rank=r, world_size=2)) for r in range(2)]
    assert len(odd[0]) == len(odd[1]) == 100 and len(set(odd[0] + odd[1])) == 200  # even: the tail of 1 dropped


def test_length_grouped_rank_from_the_job(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = LengthGroupedSampler(lengths_of(n=20), 2, seed=3)
    assert (s.rank, s.world_size) == (1, 2)
    one = list(LengthGroupedSampler(lengths_of(n=20), 2, seed=3, rank=0, world_size=1))
    assert list(s) == [i for k, i in enumerate(one) if k % 4 in (2, 3)]  # the second run of each global batch
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(DataError, match="world_size=2"):
            iter(s)
    finally:
        dist.destroy_process_group()


def test_length_grouped_bad_arguments():
    with pytest.raises(ValueError, match="lengths"):
        LengthGroupedSampler([[1, 2]], 2)
    with pytest.raises(ValueError, match="batch_size"):
        LengthGroupedSampler([1, 2], 0)
    with pytest.raises(ValueError, match="rank"):
        LengthGroupedSampler([1, 2], 1, rank=2, world_size=2)


class Pooled(ll.TaskModule):
    def __init__(self, seen):
        super().__init__()
        self.emb, self.head, self.seen = nn.Embedding(50, 4), nn.Linear(4, 3), seen

    def forward(self, batch):
        self.seen.extend(batch["idx"].tolist())
        mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)
        return self.head((self.emb(batch["input_ids"]) * mask).sum(1) / mask.sum(1))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch["idx"] % 3)


def length_grouped_run(out, stop=None, resume=None):
    data = Tokens(n=26, seed=4)
    sampler = LengthGroupedSampler([len(s) for s in data.seqs], batch_size=4, mega=2, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler, collate_fn=PaddingCollator())
    seen = []
    torch.manual_seed(0)
    model = Pooled(seen)
    fitter = ll.Fitter(max_steps=10, save_every=2, learning_rate=1e-2, output_dir=str(out), loggers=[],
                       model_summary=False, callbacks=[StopAt(stop)] if stop else [], accelerator="cpu")
    try:
        fitter.fit(model, loader, resume=resume)
    except KeyboardInterrupt:
        pass
    return seen, flat_params(model), sampler


def test_fitter_resumes_length_grouped_loader_on_the_right_sample(tmp_path):
    seen, weights, sampler = length_grouped_run(tmp_path / "full")
    # the Fitter followed the sampler: all of epoch 0 (26 samples, 7 batches), then epoch 1
    assert seen == sampler.global_order(0).tolist() + sampler.global_order(1).tolist()[:12]
    cut, _, _ = length_grouped_run(tmp_path / "cut", stop=5)  # killed after step 5; checkpoint-4 on disk
    assert cut == seen[:20]
    resumed, resumed_weights, _ = length_grouped_run(tmp_path / "cut", resume=True)
    assert resumed == seen[16:]  # steps 5..10: from sample 16 of epoch 0 on, nothing replayed
    assert torch.equal(resumed_weights, weights)


# ============================================================================================
# remove_unused_keys
# ============================================================================================
class HFStyle(nn.Module):
    def forward(self, input_ids, attention_mask=None, *args, **kwargs):
        return input_ids


class Declared(ll.TaskModule):
    batch_keys = ("input_ids", "attention_mask")


ITEMS = [{"input_ids": [1, 2], "labels": [1, 2], "text": "ab", "idx": 0}, {"input_ids": [3], "labels": [3], "text": "c", "idx": 1}]


@pytest.mark.parametrize("module", [HFStyle(), Declared()], ids=["signature", "batch_keys"])
def test_remove_unused_keys_wraps_a_collator(module, caplog, monkeypatch):
    col = remove_unused_keys(module, PaddingCollator())
    with caplog.at_level(logging.INFO, logger="lightlike"):
        first, second = col(ITEMS), col(ITEMS)
    for b in (first, second):
        assert list(b) == ["input_ids", "attention_mask", "labels"]  # labels kept: the loss reads them
        torch.testing.assert_close(b["labels"], T([[1, 2], [3, -100]]))
    logs = [r.getMessage() for r in caplog.records if "remove_unused_keys" in r.getMessage()]
    assert len(logs) == 1 and "['idx', 'text']" in logs[0] and caplog.records[0].levelno == logging.INFO
    # picklable, for DataLoader workers; of those, worker 0 alone reports
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightlike"):
        pickle.loads(pickle.dumps(remove_unused_keys(module, PaddingCollator())))(ITEMS)
        assert len(caplog.records) == 1
        monkeypatch.setattr("lightlike.data.keys.get_worker_info", lambda: type("W", (), {"id": 1})())
        remove_unused_keys(module, PaddingCollator())(ITEMS)
        assert len(caplog.records) == 1
    again = pickle.loads(pickle.dumps(col))
    assert list(again(ITEMS)) == ["input_ids", "attention_mask", "labels"]
    loader = DataLoader(ITEMS * 4, batch_size=2, collate_fn=col, num_workers=2)
    assert all(list(b) == ["input_ids", "attention_mask", "labels"] for b in loader)


def test_remove_unused_keys_on_a_batch_and_errors():
    batch = {"input_ids": T([[1]]), "token_type_ids": T([[0]]), "y": T([1])}
    assert list(remove_unused_keys(HFStyle(), batch)) == ["input_ids", "y"]
    assert list(remove_unused_keys(HFStyle(), batch, keep=())) == ["input_ids"]

    class Plain(ll.TaskModule):
        pass

    with pytest.raises(DataError, match="batch_keys"):
        remove_unused_keys(Plain(), PaddingCollator())
    with pytest.raises(DataError, match="every key"):
        remove_unused_keys(Declared(), {"x": T([1.0])})
    with pytest.raises(DataError, match="dict batches"):
        remove_unused_keys(HFStyle(), lambda items: T([1]))([1])
    with pytest.raises(TypeError, match="collection"):
        remove_unused_keys(type("Bad", (), {"batch_keys": "input_ids"})(), batch)

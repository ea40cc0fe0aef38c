"""Joining per-batch outputs (lightlike/outputs.py), cases the rest of the suite left open
(mutation testing, audit round 10): pad values by dtype, lists of per-item values, namedtuples
kept across ranks' conforming, specs merged across ranks."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightlike.errors import ModuleContractError
from lightlike.outputs import (
    PAD_VALUE,
    concat,
    conform,
    in_batch_order,
    leaf_rows,
    merge_specs,
    restore,
    spec_of,
)


def test_bool_and_unsigned_tensors_pad_with_false_and_zero():
    """[B, T_i] chunks of different T: bool pads with False, uint8 with 0, signed and float with -100."""
    for dtype, pad in ((torch.bool, False), (torch.uint8, 0), (torch.int64, PAD_VALUE), (torch.float32, PAD_VALUE)):
        a = torch.ones(2, 3, dtype=dtype)
        b = torch.ones(1, 1, dtype=dtype)
        joined = concat([a, b])
        assert joined.dtype == dtype and joined.shape == (3, 3)
        assert joined[:2].eq(torch.ones((), dtype=dtype)).all()
        assert joined[2, 0] == torch.ones((), dtype=dtype)
        assert torch.equal(joined[2, 1:], torch.full((2,), pad, dtype=dtype)), dtype


def test_padding_goes_at_the_end_of_each_dimension():
    a = torch.arange(6).reshape(1, 2, 3)
    b = torch.arange(2).reshape(1, 1, 2) + 10
    joined = concat([a, b])
    assert torch.equal(joined[1], torch.tensor([[10, 11, PAD_VALUE], [PAD_VALUE, PAD_VALUE, PAD_VALUE]]))


def test_lists_of_per_item_values_are_flattened_in_order():
    """A list field holds one value per item: batches' lists are joined into one list, and a
    lone non-list value is one item."""
    assert concat([["a", "b"], ["c"]]) == ["a", "b", "c"]
    assert concat([{"ids": ["a", "b"]}, {"ids": ["c"]}]) == {"ids": ["a", "b", "c"]}


Out = namedtuple("Out", "logits ids")  # module level: its type travels between ranks


def test_an_empty_share_conforms_to_the_merged_spec():
    """A rank with no outputs gets empty parts of the others' form: a tensor [0, ...] of their
    dtype and padded shape, an empty list; parts travel as plain tuples and come back as the
    namedtuple from the merged spec."""
    full = Out(torch.zeros(3, 4, dtype=torch.float16), ["a", "b", "c"])
    wider = Out(torch.zeros(2, 6, dtype=torch.float16), ["d", "e"])
    spec = merge_specs([spec_of(full), None, spec_of(wider)], "predictions")
    empty = conform(None, spec)
    assert empty[0].shape == (0, 6) and empty[0].dtype == torch.float16 and empty[1] == []
    padded = conform(full, spec)
    assert type(padded) is tuple and type(restore(empty, spec)) is Out
    padded = restore(padded, spec)
    assert type(padded) is Out and padded.logits.shape == (3, 6) and padded.ids == ["a", "b", "c"]
    assert torch.equal(padded.logits[:, 4:], torch.full((3, 2), PAD_VALUE, dtype=torch.float16))


def test_tuples_of_different_lengths_on_different_ranks_are_refused():
    a, b = (torch.zeros(2, 3), torch.zeros(2)), (torch.zeros(2, 3),)
    with pytest.raises(ModuleContractError, match="tuples of different lengths"):
        merge_specs([spec_of(a), spec_of(b)], "predictions")


def test_detach_cpu_detaches():
    from lightlike.outputs import detach_cpu

    x = torch.ones(2, requires_grad=True) * 2
    out = detach_cpu({"a": x, "b": (x,)})
    assert not out["a"].requires_grad and not out["b"][0].requires_grad


def test_a_namedtuple_holding_a_hugging_face_output_keeps_its_type_without_the_loss():
    """rows_only drops a ModelOutput's loss at any depth; a namedtuple around it stays a namedtuple."""
    from collections import OrderedDict

    from lightlike.outputs import rows_only

    class FakeOutput(OrderedDict):  # stands for transformers.utils.ModelOutput (matched by module)
        pass

    FakeOutput.__module__ = "transformers.modeling_outputs"
    Pair = namedtuple("Pair", "out ids")
    pred = Pair(FakeOutput(loss=torch.tensor(1.0), logits=torch.zeros(3, 2)), torch.arange(3))
    got = rows_only(pred, "here")
    assert type(got) is Pair and list(got.out) == ["logits"] and torch.equal(got.ids, torch.arange(3))


def test_whole_batches_dealt_round_robin_are_joined_back_in_batch_order():
    """Five ready-made batches of a set dealt to 2 ranks (rank 0: batches 0, 2, 4; rank 1: 1, 3),
    each rank's outputs joined in its own order, then rank by rank: ``in_batch_order`` gives the
    set's order, for every field, whatever each batch holds (a field with its own row counts, a
    list of per-item strings, a 0-d value of a one-item batch)."""
    def batch(k, rows):  # items 10k, 10k+1, ...; "lengths": one row per batch, "tags" one per item
        items = torch.arange(10 * k, 10 * k + rows)
        return {"id": items if rows > 1 else items[0], "lengths": torch.tensor([k]),
                "pair": (items * 2, [f"w{int(i)}" for i in items])}
    sizes = [3, 2, 3, 1, 2]
    chunks = [batch(k, n) for k, n in enumerate(sizes)]
    ranks = [[chunks[0], chunks[2], chunks[4]], [chunks[1], chunks[3]]]
    joined = [concat(r) for r in ranks]
    rank_by_rank = {"id": torch.cat([j["id"] for j in joined]), "lengths": torch.cat([j["lengths"] for j in joined]),
                    "pair": (torch.cat([j["pair"][0] for j in joined]), joined[0]["pair"][1] + joined[1]["pair"][1])}
    rows = [[leaf_rows(c) for c in r] for r in ranks]
    assert rows[0] == [[3, 1, 3, 3], [3, 1, 3, 3], [2, 1, 2, 2]] and rows[1][1] == [1, 1, 1, 1]
    got = in_batch_order(rank_by_rank, rows)
    want = concat(chunks)  # one process: the batches in order
    assert got["id"].tolist() == want["id"].tolist() == [0, 1, 2, 10, 11, 20, 21, 22, 30, 40, 41]
    assert got["lengths"].tolist() == [0, 1, 2, 3, 4]
    assert got["pair"][0].tolist() == [2 * i for i in want["id"].tolist()]
    assert got["pair"][1] == [f"w{i}" for i in want["id"].tolist()]

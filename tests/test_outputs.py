"""Joining per-batch outputs (lightlike/outputs.py), cases the rest of the suite left open
(mutation testing, audit round 10): pad values by dtype, lists of per-item values, namedtuples
kept across ranks' conforming, specs merged across ranks."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightlike.errors import ModuleContractError
from lightlike.outputs import PAD_VALUE, concat, conform, merge_specs, restore, spec_of


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

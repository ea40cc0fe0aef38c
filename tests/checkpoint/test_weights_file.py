"""BE mutation round: weights in and out of model.safetensors (lightlike/checkpoint/weights.py)."""
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import lightlike as ll
from lightlike.checkpoint.weights import check_shapes, save_safetensors


def test_a_long_list_of_misfits_shows_ten_and_counts_the_rest(tmp_path):
    """12 missing keys: the error names the first ten and says "... and 2 more"; it names the
    file the weights came from."""
    own = {f"k{i:02d}": (1,) for i in range(12)}
    with pytest.raises(ll.CheckpointError) as e:
        check_shapes("Net", own, {}, source="/x/model.safetensors")
    msg = str(e.value)
    assert msg.startswith("the weights from /x/model.safetensors do not fit Net:\n")
    assert "  12 missing keys (in the module, not in the checkpoint): " + ", ".join(
        f"k{i:02d}" for i in range(10)) + " ... and 2 more" in msg
    assert "k10" not in msg


def test_same_rank_other_shape_is_a_mismatch(tmp_path):
    """(3, 4) stored for a (4, 3) parameter: a shape mismatch, also with strict=False."""
    with pytest.raises(ll.CheckpointError, match=r"1 shape mismatches: w: checkpoint \(3, 4\) vs module \(4, 3\)"):
        check_shapes("Net", {"w": (4, 3)}, {"w": torch.zeros(3, 4)}, strict=False)


def test_strict_false_loads_the_common_keys_and_refuses_nothing_missing(tmp_path):
    """strict=False: missing and unexpected keys are not errors; the matching key is loaded."""
    m = nn.Linear(2, 2)
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(2, 2), "extra": torch.zeros(1)}, str(path))
    from lightlike.checkpoint.weights import load_module_state, load_safetensors

    bias = m.bias.detach().clone()
    load_module_state(m, load_safetensors(path), strict=False)
    assert torch.equal(m.weight.detach(), torch.ones(2, 2)) and torch.equal(m.bias.detach(), bias)
    with pytest.raises(ll.CheckpointError, match="1 missing keys.*bias(?s:.*)1 unexpected keys.*extra"):
        load_module_state(m, load_safetensors(path), strict=True)


def test_views_and_tied_tensors_are_saved_as_their_own_values(tmp_path):
    """A view into a larger buffer and two names for one tensor (tied weights) are written as
    plain tensors with exactly their values, and the file holds no more bytes than they need."""
    buf = torch.arange(100.0)
    tied = torch.arange(6.0).reshape(2, 3)
    state = {"head": buf[10:14], "tail": buf[90:], "a": tied, "b": tied}
    save_safetensors(state, tmp_path / "m.safetensors")
    back = load_file(str(tmp_path / "m.safetensors"))
    assert torch.equal(back["head"], torch.arange(10.0, 14.0)) and torch.equal(back["tail"], torch.arange(90.0, 100.0))
    assert torch.equal(back["a"], tied) and torch.equal(back["b"], tied)
    assert (tmp_path / "m.safetensors").stat().st_size < 100 * 4 + 4 * 4  # not the whole 100-float buffer twice

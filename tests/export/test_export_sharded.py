"""export of a sharded checkpoint through its consolidator
(lightlike/checkpoint/export.py), on one process with a stand-in consolidator."""
import json
import os
import sys
import types

import torch
from safetensors.torch import load_file, save_file
from test_export_weights import record_fsync_and_replace

from lightlike.checkpoint import CheckpointWriter
from lightlike.checkpoint import export as export_mod
from lightlike.checkpoint.export import export_weights


def _sharded(out, step, value):
    """A checkpoint of the made-up layout 'bjfake': shard-0.pt holds the weights, no model.safetensors."""
    with CheckpointWriter(out, step, meta={"kind": "full", "state_format": "bjfake"}) as w:
        w.save_torch("shard-0.pt", {"w": torch.full((3,), value)})
        w.write_json("config.json", {"step": step})
    return out / f"checkpoint-{step}"


def _fake_consolidator(monkeypatch, calls):
    fake = types.ModuleType("bj_fake_consolidator")

    def consolidate(src, out_file):
        calls.append((str(src), str(out_file)))
        state = torch.load(os.path.join(src, "shard-0.pt"), weights_only=True)
        save_file(state, str(out_file))

    fake.consolidate = consolidate
    monkeypatch.setitem(sys.modules, "bj_fake_consolidator", fake)
    monkeypatch.setitem(export_mod.CONSOLIDATORS, "bjfake", "bj_fake_consolidator:consolidate")


def test_a_sharded_checkpoint_exports_its_consolidated_weights_over_an_earlier_export(tmp_path, monkeypatch):
    """A sharded checkpoint is consolidated into out/model.safetensors (written to a temp file
    first, then put in place); over an earlier export, that export's hparams.json, which this
    checkpoint lacks, is removed, and its model.safetensors and config.json are replaced."""
    calls = []
    _fake_consolidator(monkeypatch, calls)
    ckpt = _sharded(tmp_path / "run", 4, 2.5)
    out = tmp_path / "out"
    out.mkdir()
    save_file({"w": torch.zeros(3)}, str(out / "model.safetensors"))  # an earlier export's files
    (out / "hparams.json").write_text(json.dumps({"width": 99}))
    (out / "config.json").write_text(json.dumps({"step": 1}))

    assert export_weights(ckpt, out) == out / "model.safetensors"

    assert len(calls) == 1 and calls[0][0] == str(ckpt)
    assert os.path.dirname(calls[0][1]) == str(out) and calls[0][1] != str(out / "model.safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.full((3,), 2.5))
    assert json.loads((out / "config.json").read_text()) == {"step": 4}


def test_the_consolidated_file_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    calls = []
    _fake_consolidator(monkeypatch, calls)
    ckpt = _sharded(tmp_path / "run", 4, 1.5)
    events = record_fsync_and_replace(monkeypatch)
    out = tmp_path / "out"
    export_weights(ckpt, out)
    tmp = calls[0][1]
    move = ("replace", tmp, str(out / "model.safetensors"))
    assert move in events and ("fsync", tmp) in events
    assert events.index(("fsync", tmp)) < events.index(move)


def test_a_folder_with_many_foreign_files_is_refused_naming_five_and_counting_the_rest(tmp_path):
    import pytest

    from lightlike.errors import CheckpointError

    with CheckpointWriter(tmp_path / "run", 2, meta={"kind": "full", "state_format": "full"}) as w:
        w.save_safetensors("model.safetensors", {"w": torch.ones(3)})
    out = tmp_path / "out"
    out.mkdir()
    for name in ("g", "b", "a", "f", "c", "e", "d"):
        (out / name).write_text(name)
    with pytest.raises(CheckpointError) as e:
        export_weights(tmp_path / "run" / "checkpoint-2", out)
    assert "holds files that no export wrote (a, b, c, d, e and 2 more);" in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["a", "b", "c", "d", "e", "f", "g"]


def test_an_export_in_place_leaves_the_checkpoint_files_untouched(tmp_path):
    """Exporting a checkpoint into itself writes nothing: its files keep their inode and mtime."""
    with CheckpointWriter(tmp_path / "run", 2, meta={"kind": "full", "state_format": "full"}) as w:
        w.save_safetensors("model.safetensors", {"w": torch.ones(3)})
        w.write_json("config.json", {"step": 2})
        w.write_json("hparams.json", {"width": 4})
    ckpt = tmp_path / "run" / "checkpoint-2"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpt.iterdir()}
    assert export_weights(ckpt, ckpt) == ckpt / "model.safetensors"
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpt.iterdir()} == before

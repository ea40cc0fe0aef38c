"""BE mutation round: export of a checkpoint's weights (lightlike/checkpoint/export.py)."""
import os
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

import lightlike as ll
from lightlike.checkpoint import CheckpointWriter
from lightlike.checkpoint import export as export_mod
from lightlike.checkpoint.export import export_weights


def _ckpt(out, step, value=1.0, fmt="full", weights=True):
    with CheckpointWriter(out, step, meta={"kind": "full", "state_format": fmt}) as w:
        if weights:
            w.save_safetensors("model.safetensors", {"w": torch.full((3,), value)})
        else:
            w.save_torch("shard-0.pt", {"w": torch.full((3,), value)})
        w.write_json("config.json", {"step": step})
    return out / f"checkpoint-{step}"


def test_an_output_dir_exports_its_newest_valid_checkpoint(tmp_path, caplog):
    """export of a run's output_dir (docs/migrating.md's export_hf("runs/bert", ...) did this, and
    was refused): the newest checkpoint that verifies (checkpoint-4), not the oldest (2) and not a
    newer torn one (6, a file cut short), which is named as skipped."""
    for step in (2, 4, 6):
        _ckpt(tmp_path, step, float(step))
    weights = tmp_path / "checkpoint-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    path = export_weights(tmp_path, tmp_path / "out")
    assert torch.equal(load_file(str(path))["w"], torch.full((3,), 4.0))
    note = [r.getMessage() for r in caplog.records if "using checkpoint-4" in r.getMessage()]
    assert note == [f"export {tmp_path}: using checkpoint-4, the newest valid checkpoint; skipped the newer "
                    f"{note[0].split('skipped the newer ')[1]}"] and "checkpoint-6 (" in note[0]


def test_an_output_dir_without_a_valid_checkpoint_leaves_no_folder(tmp_path):
    run = tmp_path / "run"
    _ckpt(run, 2)
    (run / "checkpoint-2" / "manifest.json").unlink()
    with pytest.raises(ll.CheckpointError, match="is a run's output_dir, not one checkpoint, and holds no valid"):
        export_weights(run, tmp_path / "a" / "b" / "out")
    assert not (tmp_path / "a").exists()


def test_a_failed_export_removes_the_folders_it_created_and_nothing_else(tmp_path, monkeypatch):
    """A failure while writing (here: copying hparams.json) leaves no new folder behind; a folder
    that was there before, and what it holds, stays."""
    ckpt = _ckpt(tmp_path / "run", 3)
    (ckpt / "hparams.json").write_text("{}")
    monkeypatch.setattr(export_mod.shutil, "copyfile", lambda *a: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(OSError, match="No space"):
        export_weights(ckpt, tmp_path / "new" / "deeper" / "out")
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="No space"):
        export_weights(ckpt, tmp_path / "kept" / "out")
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "out").exists()


def record_fsync_and_replace(monkeypatch):
    """A list that os.fsync (as ("fsync", path)) and os.replace (("replace", src, dst)) append to."""
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), replace(a, b))[1])
    return events


def test_each_exported_file_is_fsynced_then_renamed_into_place(tmp_path, monkeypatch):
    """Every exported file lands by os.replace of a temp file that was fsynced first: readers
    see the old file or the whole new one, also after a power cut."""
    ckpt = _ckpt(tmp_path / "run", 3)
    events = record_fsync_and_replace(monkeypatch)
    out = tmp_path / "out"
    export_weights(ckpt, out)
    for name in ("model.safetensors", "config.json"):
        moves = [e for e in events if e[0] == "replace" and e[2] == str(out / name)]
        assert len(moves) == 1, events
        tmp = moves[0][1]
        assert os.path.dirname(tmp) == str(out) and tmp != str(out / name)
        assert events.index(("fsync", tmp)) < events.index(moves[0])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.full((3,), 1.0))


def test_a_failed_consolidation_leaves_no_temp_file(tmp_path, monkeypatch):
    """A consolidator that fails half-way: the error comes through and the half-written temp
    file is removed, and the folder the export created with it; no model.safetensors appears."""
    ckpt = _ckpt(tmp_path / "run", 5, fmt="fake", weights=False)
    fake = types.ModuleType("be_fake_consolidator")

    def consolidate(src, out_file):
        with open(out_file, "wb") as fh:
            fh.write(b"partial")
        raise RuntimeError("shard unreadable")

    fake.consolidate = consolidate
    monkeypatch.setitem(sys.modules, "be_fake_consolidator", fake)
    monkeypatch.setitem(export_mod.CONSOLIDATORS, "fake", "be_fake_consolidator:consolidate")
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="shard unreadable"):
        export_weights(ckpt, out)
    assert not out.exists()  # nor the folder the export created


def test_a_sharded_layout_without_a_consolidator_is_a_checkpoint_error(tmp_path):
    ckpt = _ckpt(tmp_path / "run", 5, fmt="mystery", weights=False)
    with pytest.raises(ll.CheckpointError, match="has no model.safetensors to export .state_format='mystery'"):
        export_weights(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_sharded_checkpoint_is_not_exported_into_itself(tmp_path, monkeypatch):
    """In place, a consolidated model.safetensors would be a file the manifest does not list:
    refused, and the checkpoint is left exactly as it was."""
    ckpt = _ckpt(tmp_path / "run", 5, fmt="dcp", weights=False)
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(ll.CheckpointError, match="is sharded .dcp.; export it into another folder"):
        export_weights(ckpt, ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_a_file_is_named_as_a_file_not_as_a_torn_checkpoint(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ll.CheckpointError, match="is a file, not a checkpoint directory"):
        export_weights(f, tmp_path / "out")
    assert not (tmp_path / "out").exists()

"""BE mutation round: the atomic checkpoint writer (lightlike/checkpoint/atomic.py)."""
import json

import pytest
import torch

import lightlike as ll
from lightlike.checkpoint import CheckpointWriter, atomic, list_checkpoints, verify_checkpoint


def test_a_refused_overwrite_leaves_no_temp_folder(tmp_path):
    """Publishing over a valid checkpoint without overwrite raises, and the temp folder of the
    refused write goes with it: nothing but the first checkpoint is left (mutant A15)."""
    with CheckpointWriter(tmp_path, 1) as w:
        w.write_json("a.json", 1)
    with pytest.raises(ll.CheckpointError, match="refusing to overwrite"):
        with CheckpointWriter(tmp_path, 1) as w:
            w.save_torch("b.pt", torch.arange(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir()) == ["a.json", "manifest.json"]


def test_a_seal_that_fails_removes_its_temp_folder(tmp_path, monkeypatch):
    """An error while sealing (here: reading back a file a library wrote) leaves no temp folder
    and no checkpoint (mutant A14)."""
    def broken(paths, algorithms=None):
        raise OSError("read error")

    monkeypatch.setattr(atomic, "hash_files", broken)
    with pytest.raises(OSError, match="read error"):
        with CheckpointWriter(tmp_path, 2) as w:
            w.path_for("lib.bin").write_bytes(b"x" * 10)  # a library's file: checksummed at seal
    assert list(tmp_path.iterdir()) == []


def test_manifest_names_the_step_and_lists_exact_sizes_and_checksums(tmp_path):
    """manifest.json of checkpoint-7: step 7, and every file with its size and the XXH3-128 of
    its bytes on disk (computed here independently)."""
    import xxhash

    with CheckpointWriter(tmp_path, 7, meta={"kind": "full"}) as w:
        w.write_json("a.json", {"x": 1})
        w.save_torch("t.pt", {"w": torch.arange(10.0)})
        w.path_for("sub/lib.bin").write_bytes(b"abc")
    ckpt = tmp_path / "checkpoint-7"
    m = json.loads((ckpt / "manifest.json").read_text())
    assert m["step"] == 7 and m["meta"] == {"kind": "full"} and m["format"] == "lightlike-checkpoint"
    assert sorted(m["files"]) == ["a.json", "sub/lib.bin", "t.pt"]
    for rel, info in m["files"].items():
        data = (ckpt / rel).read_bytes()
        assert info == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert torch.equal(torch.load(ckpt / "t.pt", weights_only=True)["w"], torch.arange(10.0))


def test_overwrite_replaces_and_leaves_nothing_else(tmp_path):
    """overwrite=True replaces checkpoint-3 in place; no temp or trash folder is left behind."""
    for value in (1, 2):
        with CheckpointWriter(tmp_path, 3, overwrite=True) as w:
            w.write_json("v.json", value)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"]
    verify_checkpoint(tmp_path / "checkpoint-3")
    assert json.loads((tmp_path / "checkpoint-3" / "v.json").read_text()) == 2
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-3"]


def test_a_torn_checkpoint_of_that_step_is_set_aside_not_deleted(tmp_path, caplog):
    """checkpoint-4 without a manifest (an interrupted save of an older version, a copy cut
    short, another tool's folder) is not a checkpoint, and lightlike cannot prove it wrote it: a
    writer (with or without overwrite=True) moves it into set-aside-<time>/, bytes unchanged, with
    a warning naming where, instead of deleting it (mutant A17: it was replaced)."""
    for overwrite in (False, True):
        torn = tmp_path / str(overwrite) / "checkpoint-4"
        torn.mkdir(parents=True)
        (torn / "model.safetensors").write_bytes(b"half")
        with CheckpointWriter(torn.parent, 4, overwrite=overwrite) as w:
            w.write_json("a.json", 5)
        verify_checkpoint(torn)
        assert sorted(p.name for p in torn.iterdir()) == ["a.json", "manifest.json"]
        aside = [p for p in torn.parent.iterdir() if p.name.startswith("set-aside-")]
        assert len(aside) == 1 and (aside[0] / "checkpoint-4" / "model.safetensors").read_bytes() == b"half"
        assert f"moved it to {aside[0] / 'checkpoint-4'}" in caplog.text
        assert sorted(p.name for p in torn.parent.iterdir()) == ["checkpoint-4", aside[0].name]


def test_the_replaced_checkpoint_loses_its_manifest_before_its_files(tmp_path, monkeypatch):
    """Overwriting checkpoint-5: the old copy is deleted only after its manifest is gone, so a
    kill during the delete leaves no half-deleted folder that still verifies as a checkpoint.
    The delete is stopped here (rmtree made a no-op) to look at what it would leave (mutant A18)."""
    with CheckpointWriter(tmp_path, 5) as w:
        w.write_json("v.json", 1)
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *a, **k: None)
    with CheckpointWriter(tmp_path, 5, overwrite=True) as w:
        w.write_json("v.json", 2)
    ckpt = tmp_path / "checkpoint-5"
    assert json.loads((ckpt / "v.json").read_text()) == 2
    verify_checkpoint(ckpt)
    left = [p for p in tmp_path.iterdir() if p != ckpt]
    assert len(left) == 1 and json.loads((left[0] / "v.json").read_text()) == 1  # the old copy
    assert not (left[0] / "manifest.json").exists()
    with pytest.raises(ll.CheckpointError, match="manifest.json is missing"):
        verify_checkpoint(left[0], hashes=False)

"""Atomic, verified checkpoints: contents, corruption, rotation, export."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params
from safetensors.torch import load_file

import lightlike as ll
from lightlike.checkpoint import (
    CheckpointWriter,
    cleanup_stale_temps,
    find_latest_valid,
    list_checkpoints,
    rotate_checkpoints,
    verify_checkpoint,
)
from lightlike.cli import main as cli_main

FULL = {"model.safetensors", "hparams.json", "config.json", "optimizer.pt", "scheduler.pt", "precision.pt",
        "rng.pt", "callbacks.pt", "trainer_state.json", "manifest.json"}


def train(tmp_path, steps=6, **kw):
    cfg = dict(max_steps=steps, batch_size=4, save_every=2, output_dir=str(tmp_path / "run"), loggers=[])
    cfg.update(kw)
    torch.manual_seed(0)
    model = Classifier()
    result = ll.Fitter(**cfg).fit(model, DictDataset(n=40), DictDataset(n=8) if kw.get("metric_for_best") else None)
    return model, result


def test_checkpoint_contents(tmp_path):
    model, _ = train(tmp_path)
    ckpts = list_checkpoints(tmp_path / "run")
    assert [p.name for p in ckpts] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    last = ckpts[-1]
    assert {p.name for p in last.iterdir()} == FULL
    manifest = verify_checkpoint(last)
    assert set(manifest["files"]) == FULL - {"manifest.json"}
    assert manifest["step"] == 6
    weights = load_file(str(last / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert json.loads((last / "hparams.json").read_text()) == {"features": 8, "classes": 3, "width": 16}
    state = json.loads((last / "trainer_state.json").read_text())["state"]
    assert state["global_step"] == 6 and state["samples_in_epoch"] == 24
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")], "temp dirs left behind"


def test_save_only_model(tmp_path):
    train(tmp_path, save_only_model=True)
    last = list_checkpoints(tmp_path / "run")[-1]
    assert {p.name for p in last.iterdir()} == {"model.safetensors", "hparams.json", "config.json", "manifest.json"}


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete", "manifest"])
def test_corruption_detected_named_and_skipped(tmp_path, damage):
    train(tmp_path)
    out = tmp_path / "run"
    newest = out / "checkpoint-6"
    target = newest / "model.safetensors"
    if damage == "truncate":
        with open(target, "r+b") as fh:
            fh.truncate(target.stat().st_size - 10)
        expect = "model.safetensors is truncated"
    elif damage == "bitflip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x04
        target.write_bytes(bytes(data))
        expect = "model.safetensors has changed contents"
    elif damage == "delete":
        (newest / "optimizer.pt").unlink()
        expect = "optimizer.pt listed in the manifest is missing"
    else:
        (newest / "manifest.json").write_text("{ not json")
        expect = "manifest.json is unreadable"
    with pytest.raises(ll.CheckpointError, match=expect):
        verify_checkpoint(newest)
    with pytest.warns(UserWarning, match=expect):
        assert find_latest_valid(out) == out / "checkpoint-4"


def test_sizes_only_mode_misses_same_size_bitflip(tmp_path):
    """The documented trade-off of verify_hashes=False: truncation is caught, a flip is not."""
    train(tmp_path, steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    target = ckpt / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01
    target.write_bytes(bytes(data))
    verify_checkpoint(ckpt, hashes=False)
    with pytest.raises(ll.CheckpointError):
        verify_checkpoint(ckpt, hashes=True)


def test_checksums_are_crc32_and_older_sha256_manifests_still_verify(tmp_path):
    import hashlib
    import json
    import zlib

    train(tmp_path, steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel, info in manifest["files"].items():  # each file's CRC-32, computed independently
        assert info["crc32"] == f"{zlib.crc32((ckpt / rel).read_bytes()):08x}", rel
    # a manifest as earlier versions wrote it: sha256 per file
    for rel, info in manifest["files"].items():
        del info["crc32"]
        info["sha256"] = hashlib.sha256((ckpt / rel).read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    verify_checkpoint(ckpt)
    target = ckpt / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(ll.CheckpointError, match=r"model.safetensors has changed contents \(sha256 mismatch"):
        verify_checkpoint(ckpt)


def test_large_files_are_checksummed_in_parts_and_combined_exactly(tmp_path, monkeypatch):
    """crc32_combine is zlib's: CRC(a + b) from CRC(a), CRC(b), len(b); a file split into parts
    checksummed by several threads gives zlib.crc32 of the whole file, for any split."""
    import zlib

    from lightlike.checkpoint import manifest

    rng = torch.Generator().manual_seed(0)

    def data(n):
        return bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())

    for la, lb in [(0, 0), (0, 7), (7, 0), (1, 1), (100, 37), (4096, 1000), (12345, 65537)]:
        a, b = data(la), data(lb)
        assert manifest.crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b), (la, lb)
    calls = []
    real_range = manifest._crc_range
    monkeypatch.setattr(manifest, "_crc_range", lambda *a: calls.append(a[1:3]) or real_range(*a))
    monkeypatch.setattr(manifest.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(manifest, "_PART_BYTES", 1000)
    for size in (0, 999, 1000, 2001, 7777, 100_003):
        f = tmp_path / f"f{size}"
        f.write_bytes(data(size))
        calls.clear()
        for chunk in (64, 1 << 20):
            assert manifest.file_hash(f, chunk=chunk) == f"{zlib.crc32(f.read_bytes()):08x}", (size, chunk)
        parts = min(8, size // 1000)
        assert len(calls) == (2 * parts if parts > 1 else 0), (size, calls)
        if parts > 1:  # the parts tile the file
            starts = sorted(calls[:parts])
            assert starts[0][0] == 0 and sum(n for _, n in starts) == size
            assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(starts))


def test_writer_checksums_files_as_it_writes_them(tmp_path, monkeypatch):
    """torch.save streams through the CRC (no read-back, torch's own zip CRCs switched off only
    for that call; large buffers checksummed by a helper thread while they are written, small ones
    inline, chained in order); library-written files are read back; every manifest CRC is the file's."""
    import collections
    import pickle
    import zlib

    from lightlike.checkpoint import atomic, manifest

    read_back = collections.Counter()
    for mod in (atomic, manifest):
        real = mod.file_hash
        monkeypatch.setattr(mod, "file_hash", lambda p, *a, _real=real: read_back.update([p.name]) or _real(p, *a))
    optim_like = {"state": {i: {"exp_avg": torch.randn(300, 7)} for i in range(3)}, "param_groups": [{"lr": 0.1}]}
    optim_like["state"][1]["exp_avg_sq"] = torch.randn(1024, 520)  # over 2 MiB: checksummed by a helper
    overlapped = []
    real_write = atomic._Checksummed.write
    monkeypatch.setattr(atomic, "_OVERLAP_BYTES", 4096)  # the 8 KiB records too: helper and inline interleave
    monkeypatch.setattr(atomic._Checksummed, "write", lambda self, data: overlapped.append(
        memoryview(data).nbytes >= 4096 and self.pool is not None) or real_write(self, data))
    with CheckpointWriter(tmp_path, 7) as w:
        w.save_torch("optimizer.pt", optim_like)
        w.save_safetensors("model.safetensors", {"w": torch.randn(5, 5)})
        w.write_json("state.json", {"step": 7})
        w.path_for("lib/shard.bin").write_bytes(b"written by a library" * 100)
        with pytest.raises((pickle.PicklingError, AttributeError)):  # a local lambda cannot be pickled
            w.save_torch("bad.pt", lambda: 0)
        assert torch.serialization.get_crc32_options() is True  # restored, also after the failure
        (w.tmp / "bad.pt").unlink()
    ckpt = tmp_path / "checkpoint-7"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert sorted(files) == ["lib/shard.bin", "model.safetensors", "optimizer.pt", "state.json"]
    for rel, info in files.items():
        assert info["crc32"] == f"{zlib.crc32((ckpt / rel).read_bytes()):08x}", rel
    assert read_back == {"model.safetensors": 1, "shard.bin": 1}
    assert overlapped.count(True) >= 4 and overlapped.count(False) >= 4, overlapped
    loaded = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert torch.equal(loaded["state"][2]["exp_avg"], optim_like["state"][2]["exp_avg"])
    assert torch.equal(loaded["state"][1]["exp_avg_sq"], optim_like["state"][1]["exp_avg_sq"])
    verify_checkpoint(ckpt, hashes=True)


def test_resume_checksums_each_file_once(tmp_path, monkeypatch):
    """resume=True verifies checkpoints to choose one; loading it then checks sizes only,
    not every checksum a second time. An explicit resume path is checksummed by the load."""
    import collections

    from lightlike.checkpoint import manifest

    train(tmp_path, steps=4)
    calls = collections.Counter()
    real = manifest.file_hash

    def counting(path, *args):
        calls[os.path.basename(path)] += 1
        return real(path, *args)

    monkeypatch.setattr(manifest, "file_hash", counting)
    ckpt = tmp_path / "run" / "checkpoint-4"
    names = set(json.loads((ckpt / "manifest.json").read_text())["files"])
    for resume in (True, str(ckpt)):
        calls.clear()
        ll.Fitter(max_steps=6, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[],
                  save_strategy="no").fit(Classifier(), DictDataset(n=40), resume=resume)
        assert set(calls) == names and set(calls.values()) == {1}, (resume, calls)


def test_writer_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="disk on fire"):
        with CheckpointWriter(tmp_path, 3) as w:
            w.write_json("a.json", {"x": 1})
            raise RuntimeError("disk on fire")
    assert list(tmp_path.iterdir()) == []


def test_killed_writer_leaves_no_checkpoint(tmp_path):
    code = f"""
import os, torch
from lightlike.checkpoint import CheckpointWriter
w = CheckpointWriter({str(tmp_path)!r}, 7).__enter__()
w.save_torch("big.pt", torch.zeros(1000))
os._exit(9)
"""
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert list_checkpoints(tmp_path) == []
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-7.tmp-")]
    assert len(leftovers) == 1
    assert cleanup_stale_temps(tmp_path) == leftovers
    assert list(tmp_path.iterdir()) == []


def test_sigkill_during_saves_never_leaves_a_bad_checkpoint(tmp_path):
    code = f"""
import torch
from lightlike.checkpoint import CheckpointWriter
step = 0
while True:
    step += 1
    with CheckpointWriter({str(tmp_path)!r}, step % 3, overwrite=True) as w:
        w.save_safetensors("model.safetensors", {{"w": torch.full((1_000_000,), float(step))}})
        w.write_json("meta.json", {{"step": step}})
"""
    import random
    import time

    rng = random.Random(0)
    for _ in range(4):
        proc = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(1.0 + rng.random())
        proc.kill()
        proc.wait()
        for ckpt in list_checkpoints(tmp_path):
            verify_checkpoint(ckpt)  # every visible checkpoint is complete
            w = load_file(str(ckpt / "model.safetensors"))["w"]
            assert torch.all(w == w[0])
    assert list_checkpoints(tmp_path), "no checkpoint was ever committed"


def test_refuses_to_overwrite_a_valid_checkpoint(tmp_path):
    with CheckpointWriter(tmp_path, 1) as w:
        w.write_json("a.json", 1)
    with pytest.raises(ll.CheckpointError, match="refusing to overwrite"):
        with CheckpointWriter(tmp_path, 1) as w:
            w.write_json("a.json", 2)
    assert json.loads((tmp_path / "checkpoint-1" / "a.json").read_text()) == 1


def test_rotation_keeps_newest_best_and_resume_source(tmp_path):
    for step in range(1, 7):
        with CheckpointWriter(tmp_path, step) as w:
            w.write_json("a.json", step)
    deleted = rotate_checkpoints(tmp_path, 2, protect=[tmp_path / "checkpoint-2", tmp_path / "checkpoint-3"])
    # 2, 3 protected, 6 newest: all others go, even though that leaves 3 > limit
    assert [p.name for p in deleted] == ["checkpoint-1", "checkpoint-4", "checkpoint-5"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3", "checkpoint-6"]
    assert rotate_checkpoints(tmp_path, None) == []


def test_fit_rotation_never_deletes_best(tmp_path):
    class FirstIsBest(Classifier):
        evals = 0

        def metrics(self, outputs, batch):
            return {"score": torch.tensor(-float(type(self).evals))}

    class Count(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            type(fitter.module).evals += 1

    torch.manual_seed(0)
    result = ll.Fitter(max_steps=10, batch_size=4, save_every=2, eval_every=2, save_total_limit=2,
                       metric_for_best="val/score", greater_is_better=True, load_best_at_end=True,
                       output_dir=str(tmp_path / "run"), loggers=[], callbacks=[Count()]
                       ).fit(FirstIsBest(), DictDataset(n=40), DictDataset(n=8))
    names = [p.name for p in list_checkpoints(tmp_path / "run")]
    assert names == ["checkpoint-2", "checkpoint-10"]
    assert result.best_checkpoint.endswith("checkpoint-2")


def test_load_best_at_end_restores_best_weights(tmp_path):
    model, result = train(tmp_path, steps=6, eval_every=2, metric_for_best="val/loss", load_best_at_end=True)
    best = load_file(os.path.join(result.best_checkpoint, "model.safetensors"))
    assert all(torch.equal(best[k], v) for k, v in model.state_dict().items())


def test_export_cli_and_load_weights(tmp_path, capsys):
    model, _ = train(tmp_path, steps=2)
    out = tmp_path / "export"
    assert cli_main(["export", str(tmp_path / "run" / "checkpoint-2"), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hparams.json", "model.safetensors"]
    fresh = Classifier(**json.loads((out / "hparams.json").read_text()))
    fresh.load_state_dict(load_file(str(out / "model.safetensors")))
    assert torch.equal(flat_params(fresh), flat_params(model))
    other = Classifier()
    other.load_weights(out)
    assert torch.equal(flat_params(other), flat_params(model))
    wrong = Classifier(width=5)
    with pytest.raises(ll.CheckpointError, match=r"shape mismatches: net.0.weight: checkpoint \(16, 8\) vs module \(5, 8\)"):
        wrong.load_weights(out)
    # the console script form, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "lightlike.cli", "export", str(tmp_path / "nope"), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "manifest.json is missing" in proc.stderr


def test_resume_errors(tmp_path):
    with pytest.raises(ll.CheckpointError, match="holds no valid checkpoint"):
        ll.Fitter(max_steps=2, output_dir=str(tmp_path / "empty"), loggers=[]).fit(Classifier(), DictDataset(), resume=True)
    train(tmp_path, steps=2, save_only_model=True)
    with pytest.raises(ll.CheckpointError, match="weights only"):
        ll.Fitter(max_steps=4, output_dir=str(tmp_path / "run"), loggers=[]).fit(Classifier(), DictDataset(), resume=True)
    train(tmp_path / "b", steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ll.CheckpointError, match=r"(?s)do not fit Classifier:.*shape mismatches"):
            ll.Fitter(max_steps=4, output_dir=str(tmp_path / "b" / "run"), loggers=[]).fit(
                Classifier(width=3), DictDataset(), resume=True)

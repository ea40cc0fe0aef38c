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


def train(tmp_path, steps=6, resume=None, **kw):
    cfg = dict(max_steps=steps, batch_size=4, save_every=2, output_dir=str(tmp_path / "run"), loggers=[])
    cfg.update(kw)
    torch.manual_seed(0)
    model = Classifier()
    result = ll.Fitter(**cfg).fit(model, DictDataset(n=40), DictDataset(n=8) if kw.get("metric_for_best") else None,
                                  resume=resume)
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
    with pytest.raises(ll.CheckpointError, match=r"file optimizer.pt has changed contents \(\w+ mismatch"):
        verify_checkpoint(ckpt, hashes=True)


def test_a_manifest_of_a_newer_layout_is_refused_by_name(tmp_path):
    """A checkpoint whose manifest says a version this lightlike does not know: refused, saying
    to upgrade (it was read as if it were version 1); resume=True falls back past it."""
    import json

    train(tmp_path, steps=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["version"] == 1
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    with pytest.raises(ll.CheckpointError, match="written by a newer lightlike .*version 2.*upgrade lightlike"):
        verify_checkpoint(ckpt)
    with pytest.warns(UserWarning, match="skipping invalid checkpoint"):
        assert find_latest_valid(tmp_path / "run").name == "checkpoint-2"


def test_checksums_are_xxh3_128(tmp_path):
    import json

    import xxhash

    train(tmp_path, steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel, info in manifest["files"].items():  # each file's XXH3-128, computed independently
        assert info == {"size": (ckpt / rel).stat().st_size,
                        "xxh3_128": xxhash.xxh3_128((ckpt / rel).read_bytes()).hexdigest()}, rel
    target = ckpt / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(ll.CheckpointError, match=r"model.safetensors has changed contents \(xxh3_128 mismatch"):
        verify_checkpoint(ckpt)


def test_a_checkpoint_with_crc32_checksums_still_verifies_and_loads(tmp_path):
    """A checkpoint whose manifest lists CRC-32s (``{"size", "crc32"}`` per file, as lightlike
    wrote them before XXH3, made here with zlib.crc32) verifies, resumes and loads its weights;
    a flipped bit in one of its files is still caught, named as a crc32 mismatch."""
    import json
    import shutil
    import zlib

    whole, _ = train(tmp_path, steps=6)
    shutil.rmtree(tmp_path / "run" / "checkpoint-6")
    ckpt = tmp_path / "run" / "checkpoint-4"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {rel: {"size": info["size"], "crc32": f"{zlib.crc32((ckpt / rel).read_bytes()):08x}"}
                         for rel, info in manifest["files"].items()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    assert verify_checkpoint(ckpt)["files"] == manifest["files"]
    module = Classifier()
    module.load_weights(ckpt)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in load_file(str(ckpt / "model.safetensors")).items())
    resumed, _ = train(tmp_path, steps=6, resume=str(ckpt))
    assert torch.equal(flat_params(resumed), flat_params(whole))  # every file of it loaded, bit for bit
    target = ckpt / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ll.CheckpointError, match=r"optimizer.pt has changed contents \(crc32 mismatch"):
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
    real_range = manifest.crc_range
    monkeypatch.setattr(manifest, "crc_range", lambda *a: calls.append(a[1:3]) or real_range(*a))
    for size in (0, 999, 1000, 2001, 7777, 100_003):
        f = tmp_path / f"f{size}"
        f.write_bytes(data(size))
        calls.clear()
        for chunk in (64, 1 << 20):
            got = manifest.file_hash(f, "crc32", chunk=chunk, part_bytes=1000, max_parts=8)
            assert got == f"{zlib.crc32(f.read_bytes()):08x}", (size, chunk)
        parts = min(8, size // 1000)
        assert len(calls) == (2 * parts if parts > 1 else 0), (size, calls)
        if parts > 1:  # the parts tile the file
            starts = sorted(calls[:parts])
            assert starts[0][0] == 0 and sum(n for _, n in starts) == size
            assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(starts))


def test_writer_checksums_files_as_it_writes_them(tmp_path, monkeypatch):
    """torch.save streams through the hash (no read-back, torch's own zip CRCs switched off only
    for that call; large buffers hashed by a helper thread while they are written, small ones
    inline, in order); library-written files are read back; every manifest checksum is the file's."""
    import collections
    import pickle

    import xxhash

    from lightlike.checkpoint import atomic, manifest

    read_back = collections.Counter()
    for mod in (atomic, manifest):
        real = mod.file_hash
        monkeypatch.setattr(mod, "file_hash", lambda p, *a, _real=real: read_back.update([p.name]) or _real(p, *a))
    optim_like = {"state": {i: {"exp_avg": torch.randn(300, 7)} for i in range(3)}, "param_groups": [{"lr": 0.1}]}
    optim_like["state"][1]["exp_avg_sq"] = torch.randn(1024, 520)  # over 2 MiB: checksummed by a helper
    sinks = []

    class Watched(atomic.Checksummed):  # every sink save_torch writes through, with its own counts
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            sinks.append(self)

    monkeypatch.setattr(atomic, "OVERLAP_BYTES", 4096)  # the 8 KiB records too: helper and inline interleave
    monkeypatch.setattr(atomic, "Checksummed", Watched)
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
        assert info["xxh3_128"] == xxhash.xxh3_128((ckpt / rel).read_bytes()).hexdigest(), rel
    assert read_back == {"model.safetensors": 1, "shard.bin": 1}
    counts = [(s.overlapped, s.inline) for s in sinks]
    assert sum(o for o, _ in counts) >= 4 and sum(i for _, i in counts) >= 4, counts
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


def test_a_live_writers_temp_folder_is_named_by_its_pid_and_survives_cleanup(tmp_path):
    """cleanup_stale_temps (run at every fit start) keeps the temp folder of a save in progress:
    it is named after this process, which is alive."""
    with CheckpointWriter(tmp_path, 5) as w:
        w.write_json("a.json", {"x": 1})
        assert w.tmp.name.startswith(f".checkpoint-5.tmp-{os.getpid()}-")
        assert cleanup_stale_temps(tmp_path) == []
        assert (w.tmp / "a.json").is_file()
    verify_checkpoint(tmp_path / "checkpoint-5")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names file descriptors by /proc/self/fd")
def test_writer_fsyncs_every_file_folder_and_the_manifest_before_the_rename(tmp_path, monkeypatch):
    """Durability: each file (also one a library wrote itself), each folder of the temp tree and
    the manifest reach the disk before the rename makes the checkpoint visible; the output
    folder (the rename itself) right after it."""
    events = []
    fsync, rename = os.fsync, os.rename

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_rename(src, dst):
        events.append(("rename", str(src)))
        return rename(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", recording_rename)
    with CheckpointWriter(tmp_path, 1) as w:
        w.write_json("a.json", {"x": 1})
        w.save_torch("sub/b.pt", torch.zeros(3))
        w.save_safetensors("c.safetensors", {"w": torch.zeros(3)})
        w.path_for("d.bin").write_bytes(b"by a library")
        tmp = str(w.tmp)
    cut = events.index(("rename", tmp))
    before = {path for _, path in events[:cut]}
    names = ["a.json", "sub/b.pt", "c.safetensors", "d.bin", "manifest.json", "sub"]
    assert {f"{tmp}/{rel}" for rel in names} | {tmp} <= before
    manifest_synced = events.index(("fsync", f"{tmp}/manifest.json"))
    assert ("fsync", tmp) in events[manifest_synced + 1:cut]  # the manifest's folder entry too
    assert ("fsync", str(tmp_path)) in events[cut + 1:]
    verify_checkpoint(tmp_path / "checkpoint-1")


def test_a_manifest_of_another_format_is_refused(tmp_path):
    """A manifest.json with a files table but another format name is not a lightlike checkpoint."""
    train(tmp_path, steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "format": "other"}))
    with pytest.raises(ll.CheckpointError, match="not a lightlike manifest .*format 'other'"):
        verify_checkpoint(ckpt, hashes=False)


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
print("ready", flush=True)
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
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"  # imports done (slow on a loaded machine): saving now
        time.sleep(0.3 + rng.random())
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


def test_export_cli_and_load_weights(tmp_path, capsys, caplog):
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
    assert proc.returncode == 2 and "no such checkpoint directory" in proc.stderr
    # a second export into the same folder, of a checkpoint without hparams.json: the first one's
    # must not stay beside the new weights (it described another model), and the replacing is said
    ckpt = tmp_path / "run" / "checkpoint-2"
    for name in ("hparams.json", "config.json"):
        (ckpt / name).unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in ("hparams.json", "config.json"):
        manifest["files"].pop(name)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    from lightlike.checkpoint.export import export_weights

    with caplog.at_level("WARNING", logger="lightlike"):
        export_weights(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert "replaced model.safetensors, hparams.json, config.json" in caplog.text


def test_resume_errors(tmp_path):
    with pytest.raises(ll.CheckpointError, match="holds no valid checkpoint"):
        ll.Fitter(max_steps=2, output_dir=str(tmp_path / "empty"), loggers=[]).fit(Classifier(), DictDataset(), resume=True)
    train(tmp_path, steps=2, save_only_model=True)
    with pytest.raises(ll.CheckpointError, match="weights-only ones, from save_only_model, cannot resume"):
        ll.Fitter(max_steps=4, output_dir=str(tmp_path / "run"), loggers=[]).fit(Classifier(), DictDataset(), resume=True)
    with pytest.raises(ll.CheckpointError, match="weights only"):  # named explicitly
        ll.Fitter(max_steps=4, output_dir=str(tmp_path / "run"), loggers=[]).fit(
            Classifier(), DictDataset(), resume=str(tmp_path / "run" / "checkpoint-2"))
    train(tmp_path / "b", steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ll.CheckpointError, match=r"(?s)do not fit Classifier:.*shape mismatches"):
            ll.Fitter(max_steps=4, output_dir=str(tmp_path / "b" / "run"), loggers=[]).fit(
                Classifier(width=3), DictDataset(n=40), resume=True)  # the checkpoint's data (40 items)

    class Extra(Classifier):  # a parameter the checkpoint lacks
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 3)

    class Fewer(Classifier):  # a checkpoint parameter the module lacks
        def __init__(self):
            super().__init__()
            del self.net[2]

    for module, expect in ((Extra(), r"missing keys \(in the module, not in the checkpoint\): head.weight, head.bias"),
                           (Fewer(), r"unexpected keys \(in the checkpoint, not in the module\): net.2.bias, net.2.weight")):
        with pytest.raises(ll.CheckpointError, match=expect):
            ll.Fitter(max_steps=4, output_dir=str(tmp_path / "b" / "run"), loggers=[]).fit(
                module, DictDataset(n=40), resume=True)


# -- resuming into an output_dir that holds more than the checkpoint -----------------------------------
class SaveSpy(ll.Callback):
    def __init__(self):
        self.saved = []

    def on_save(self, fitter, state, control, path):
        self.saved.append((os.path.basename(path), os.path.isdir(path)))


def test_rollback_moves_newer_checkpoints_aside(tmp_path):
    """Resuming from checkpoint-4 of a run that went on to 10: checkpoints 6-10 of the abandoned
    continuation go to abandoned-<time>/ (kept, named in a warning); rotation then keeps what this
    run saves, and a later resume=True finds this run's checkpoint, not the abandoned one."""
    out = tmp_path / "run"
    train(tmp_path, steps=10, loggers=["csv"])
    spy = SaveSpy()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="older than checkpoint-6, checkpoint-8, checkpoint-10"):
        ll.Fitter(max_steps=10, batch_size=4, save_every=2, save_total_limit=2, max_grad_norm=0.5,
                  output_dir=str(out), loggers=["csv"], callbacks=[spy]).fit(
            Classifier(), DictDataset(n=40), resume=str(out / "checkpoint-4"))
    assert spy.saved == [("checkpoint-6", True), ("checkpoint-8", True), ("checkpoint-10", True)]
    # save_total_limit=2 holds after a resume: checkpoint-4, the resume source, goes once newer ones exist
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-8", "checkpoint-10"]
    (aside,) = [p for p in out.iterdir() if p.name.startswith("abandoned-")]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-10", "checkpoint-6", "checkpoint-8", "logs"]
    for p in aside.glob("checkpoint-*"):
        verify_checkpoint(p)
        assert json.loads((p / "config.json").read_text())["max_grad_norm"] is None  # the first run's
    latest = find_latest_valid(out)
    assert json.loads((latest / "config.json").read_text())["max_grad_norm"] == 0.5  # this run's


def test_stale_temp_and_trash_dirs_are_removed_at_fit_start(tmp_path):
    out = tmp_path / "run"
    train(tmp_path, steps=4)
    dead = 2**22 + 12345  # above pid_max: no such process
    stale = [out / f".checkpoint-6.tmp-{dead}-abcd1234", out / ".trash-checkpoint-4-deadbeef"]
    live = out / f".checkpoint-8.tmp-{os.getppid()}-00000000"  # a live process's save: kept
    for d in (*stale, live):
        d.mkdir()
        (d / "optimizer.pt").write_bytes(b"x" * 1000)
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]  # never counted
    train(tmp_path, steps=8, resume=True)
    assert not any(p.exists() for p in stale) and live.exists()
    # a fresh fit (overwrite_output_dir) cleans up too
    stale[0].mkdir()
    train(tmp_path, steps=2, overwrite_output_dir=True)
    assert not stale[0].exists()


def test_resume_true_falls_back_past_a_corrupt_newest_checkpoint(tmp_path):
    """The newest checkpoint is damaged: resume=True warns naming it, resumes from the one before
    (moving the damaged one aside) and ends with the uninterrupted run's weights."""
    ref, _ = train(tmp_path / "ref", steps=6)
    train(tmp_path, steps=6)
    target = tmp_path / "run" / "checkpoint-6" / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checkpoint-6: file optimizer.pt has changed contents"):
        model, result = train(tmp_path, steps=6, resume=True)
    assert result.global_step == 6
    assert torch.equal(flat_params(model), flat_params(ref))
    verify_checkpoint(tmp_path / "run" / "checkpoint-6")  # written anew by the resumed run


def test_preemption_checkpoint_is_full_with_save_only_model(tmp_path):
    """checkpointer.save(full=True), the preemption save, writes a resumable checkpoint
    (over a weights-only one of the same step) whatever save_only_model says."""
    torch.manual_seed(0)
    fitter = ll.Fitter(max_steps=2, batch_size=4, save_every=2, save_only_model=True,
                       output_dir=str(tmp_path / "run"), loggers=[])
    fitter.fit(Classifier(), DictDataset(n=40))
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert verify_checkpoint(ckpt)["meta"]["kind"] == "model"
    fitter.checkpointer.save(full=True)
    assert verify_checkpoint(ckpt)["meta"]["kind"] == "full" and (ckpt / "optimizer.pt").is_file()
    _, result = train(tmp_path, steps=4, save_only_model=True, resume=True)
    assert result.global_step == 4


def test_preemption_with_save_only_model_resumes(tmp_path):
    """End to end: SIGTERM with save_only_model=True, then resume=True (the requeued job)."""
    import signal

    from lightlike.preemption import Preempted

    class Term(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    torch.manual_seed(0)
    with pytest.raises(Preempted, match=r"preempted by SIGTERM; checkpoint \S+checkpoint-3; exit code 75"):
        ll.Fitter(max_steps=6, batch_size=4, save_every=100, save_only_model=True, output_dir=str(tmp_path / "run"),
                  loggers=[], callbacks=[Term()]).fit(Classifier(), DictDataset(n=40))
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-3")["meta"]["kind"] == "full"
    _, result = train(tmp_path, steps=6, save_every=100, save_only_model=True, resume=True)
    assert result.global_step == 6


class SignalAtStep3(ll.Callback):
    """SIGTERM after step 3; records (folder, kind) of every checkpoint on_save sees."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, fitter, state, control):
        if state.global_step == 3:
            import signal

            os.kill(os.getpid(), signal.SIGTERM)

    def on_save(self, fitter, state, control, path):
        self.seen.append((os.path.basename(path), verify_checkpoint(path)["meta"]["kind"]))


def test_preemption_at_a_weights_only_save_step_commits_twice_full_last(tmp_path):
    """Signal at a step that writes a weights-only checkpoint: the folder is replaced by a full
    one, and on_save sees both commits in that order (documented in docs/checkpoints.md)."""
    from lightlike.preemption import Preempted

    probe = SignalAtStep3()
    torch.manual_seed(0)
    with pytest.raises(Preempted, match=r"preempted by SIGTERM; checkpoint \S+checkpoint-3; exit code 75"):
        ll.Fitter(max_steps=6, batch_size=4, save_every=3, save_only_model=True, output_dir=str(tmp_path / "run"),
                  loggers=[], callbacks=[probe]).fit(Classifier(), DictDataset(n=40))
    assert probe.seen == [("checkpoint-3", "model"), ("checkpoint-3", "full")]


@pytest.mark.parametrize("async_save", [False, True])
def test_preemption_at_a_full_save_step_commits_that_checkpoint_once(tmp_path, async_save):
    """Signal at a step whose full checkpoint was just written (committed in the background with
    async_save): it is not written again, it is committed before the exit (on_save sees it once,
    valid), and Preempted names it, not the step before."""
    from lightlike.preemption import Preempted

    probe = SignalAtStep3()
    out = tmp_path / "run"
    torch.manual_seed(0)
    with pytest.raises(Preempted) as exc:
        ll.Fitter(max_steps=6, batch_size=4, save_every=3, async_save=async_save, output_dir=str(out),
                  loggers=[], callbacks=[probe]).fit(Classifier(), DictDataset(n=40))
    assert exc.value.code == 75 and exc.value.checkpoint == str(out / "checkpoint-3")
    assert probe.seen == [("checkpoint-3", "full")]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]


# -- the best checkpoint ------------------------------------------------------------------------------
class Scored(Classifier):
    """val/score is SCORES[step of the evaluation]."""
    SCORES: dict = {}
    step = 0

    def metrics(self, outputs, batch):
        return {"score": torch.tensor(float(self.SCORES[type(self).step]))}


class TrackStep(ll.Callback):
    def on_step_end(self, fitter, state, control):
        type(fitter.module).step = state.global_step


def test_best_checkpoint_is_only_the_best_steps_own(tmp_path, caplog):
    """Best at step 6, which has no checkpoint (saves at 4, 8, 10): best_checkpoint is None, not
    checkpoint-4; and loading "the best" from another step's checkpoint is refused."""
    class M(Scored):
        SCORES = {2: 1.0, 4: 5.0, 6: 10.0, 8: 2.0, 10: 0.0}

    torch.manual_seed(0)
    fitter = ll.Fitter(max_steps=10, batch_size=4, save_every=4, eval_every=2, metric_for_best="val/score",
                       greater_is_better=True, output_dir=str(tmp_path / "run"), loggers=[], callbacks=[TrackStep()])
    result = fitter.fit(M(), DictDataset(n=40), DictDataset(n=8))
    assert result.state.best_step == 6 and result.best_checkpoint is None
    before = flat_params(fitter.module)
    fitter.state.best_checkpoint = str(tmp_path / "run" / "checkpoint-4")  # as older versions left it
    with caplog.at_level("WARNING", logger="lightlike"):
        fitter.checkpointer.load_weights(tmp_path / "run" / "checkpoint-4")
    assert "best evaluation (step 6) has no checkpoint" in caplog.text
    assert fitter.state.best_checkpoint is None and torch.equal(flat_params(fitter.module), before)


def test_best_checkpoint_survives_a_resume_from_another_working_directory(tmp_path, monkeypatch):
    """A relative output_dir: the best checkpoint is stored by name, so a run resumed from
    another cwd (given the absolute path) still protects it from rotation and loads it."""

    class M(Scored):
        SCORES = {2: 10.0, 4: 1.0, 6: 2.0, 8: 3.0, 10: 4.0, 12: 5.0}

    def go(out, steps, resume=None):
        torch.manual_seed(0)
        return ll.Fitter(max_steps=steps, batch_size=4, save_every=2, eval_every=2, metric_for_best="val/score",
                         greater_is_better=True, load_best_at_end=True, save_total_limit=2, output_dir=out,
                         loggers=[], callbacks=[TrackStep()]).fit(M(), DictDataset(n=40), DictDataset(n=8), resume=resume)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    go("run", 6)
    state = json.loads((tmp_path / "a" / "run" / "checkpoint-6" / "trainer_state.json").read_text())["state"]
    assert state["best_checkpoint"] == "checkpoint-2"
    monkeypatch.chdir(tmp_path / "b")
    result = go(str(tmp_path / "a" / "run"), 12, resume=True)
    # kept: the best and the newest (save_total_limit=2); the resume source went once newer ones existed
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "run")] == ["checkpoint-2", "checkpoint-12"]
    assert result.best_checkpoint == str(tmp_path / "a" / "run" / "checkpoint-2")


# -- weights --------------------------------------------------------------------------------------------
def test_compiled_module_writes_plain_weight_names(tmp_path, monkeypatch):
    """compile=True: the checkpoint's weights carry the module's own names (no `_orig_mod.`), so
    they load into a fresh module, and the run resumes."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model, _ = train(tmp_path, steps=2, compile=True)
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert sorted(load_file(str(ckpt / "model.safetensors"))) == sorted(Classifier().state_dict())
    fresh = Classifier()
    fresh.load_weights(ckpt)
    assert torch.equal(flat_params(fresh), flat_params(model))
    _, result = train(tmp_path, steps=4, compile=True, resume=True)
    assert result.global_step == 4


def test_load_weights_verifies_a_checkpoint(tmp_path):
    train(tmp_path, steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    target = ckpt / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes: the file still parses
    target.write_bytes(bytes(data))
    for path in (ckpt, target):
        with pytest.raises(ll.CheckpointError, match="model.safetensors has changed contents"):
            Classifier().load_weights(path)
    Classifier().load_weights(ckpt, verify_hashes=False)  # sizes only, as documented


def test_load_weights_not_strict_says_what_it_left_out(tmp_path, caplog):
    """strict=False loads what matches and lists the rest (as torch returns it and Lightning and
    HF log it): with no key in common it used to load nothing without a word."""
    from safetensors.torch import save_file

    module = Classifier()
    renamed = {k.replace("net.", "model."): v.clone() + 1 for k, v in module.state_dict().items()}
    renamed["net.0.bias"] = module.state_dict()["net.0.bias"] + 5  # the one key that matches
    save_file(renamed, str(tmp_path / "w.safetensors"))
    before = module.state_dict()["net.2.weight"].clone()
    with caplog.at_level("WARNING", logger="lightlike"):
        module.load_weights(tmp_path / "w.safetensors", strict=False)
    assert torch.equal(module.state_dict()["net.0.bias"], renamed["net.0.bias"])
    assert torch.equal(module.state_dict()["net.2.weight"], before)
    assert "3 missing keys (kept as they were): net.0.weight, net.2.weight, net.2.bias" in caplog.text
    assert "4 unexpected keys (ignored): model.0.bias, model.0.weight, model.2.bias, model.2.weight" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_rewriting_a_checkpoint_swaps_it_in_one_step(tmp_path, monkeypatch):
    """Writing over checkpoint-N moved the old one aside and then renamed the new one in: a kill
    between the two left no checkpoint-N (with save_total_limit=1, none at all, and resume='auto'
    started the run again). Now the two directories are exchanged atomically; a kill at any
    instant leaves the old or the new checkpoint-N."""
    from lightlike.checkpoint import atomic

    for value in (1.0, 2.0):
        with CheckpointWriter(tmp_path, 5, overwrite=True) as w:
            w.save_safetensors("model.safetensors", {"w": torch.full((4,), value)})
            if value == 2.0:  # the second write: no plain rename may run while checkpoint-5 exists
                def no_rename(src, dst):
                    raise AssertionError(f"rename {src} -> {dst} while checkpoint-5 exists")
                monkeypatch.setattr(atomic.os, "rename", no_rename)
    monkeypatch.undo()
    verify_checkpoint(tmp_path / "checkpoint-5")
    assert load_file(str(tmp_path / "checkpoint-5" / "model.safetensors"))["w"].tolist() == [2.0] * 4
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]  # the old one removed, nothing left over


def test_export_verifies_checksums_unless_told_not_to(tmp_path, capsys):
    """A same-size bit flip in the weights' tensor data: export (API and command line) refuses
    it naming the file and writes nothing; with hashes=False / --no-verify-hashes it checks sizes
    only and copies the file as it is."""
    from lightlike.checkpoint.export import export_weights

    train(tmp_path, steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    target = ckpt / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01  # the last tensor's last byte: the header still parses, the size is the same
    target.write_bytes(bytes(data))
    load_file(str(target))  # still a readable safetensors file
    with pytest.raises(ll.CheckpointError, match=r"model\.safetensors has changed contents"):
        export_weights(ckpt, tmp_path / "api")
    assert not (tmp_path / "api").exists()
    assert export_weights(ckpt, tmp_path / "api", hashes=False) == tmp_path / "api" / "model.safetensors"
    assert (tmp_path / "api" / "model.safetensors").read_bytes() == bytes(data)

    capsys.readouterr()
    assert cli_main(["export", str(ckpt), str(tmp_path / "cli")]) != 0
    err = capsys.readouterr().err
    assert "model.safetensors has changed contents" in err and "mismatch" in err
    assert not (tmp_path / "cli" / "model.safetensors").exists()
    assert cli_main(["export", str(ckpt), str(tmp_path / "cli"), "--no-verify-hashes"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == bytes(data)


def test_output_dir_of_weights_only_checkpoints_offers_resume_auto_not_resume_true(tmp_path):
    """save_only_model checkpoints cannot be resumed: a fresh fit into their output_dir is refused
    with resume='auto' (which moves them aside) as the advice, and that advice works."""
    train(tmp_path, steps=2, save_only_model=True)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-2"]
    with pytest.raises(ll.OutputDirError, match="already holds a run") as caught:
        train(tmp_path, steps=2)
    message = str(caught.value)
    assert "resume=True" not in message and "it holds no resumable checkpoint: pass resume='auto'" in message
    assert caught.value.offers == ("resume='auto'", "overwrite_output_dir=True")
    _, result = train(tmp_path, steps=2, resume="auto")
    assert result.global_step == 2 and verify_checkpoint(tmp_path / "run" / "checkpoint-2")["step"] == 2
    assert any(p.name.startswith("abandoned-") for p in (tmp_path / "run").iterdir())


def test_a_leftover_temp_file_of_an_interrupted_export_does_not_block_a_new_one(tmp_path):
    from lightlike.checkpoint.export import export_weights

    train(tmp_path, steps=2)
    ckpt, out = tmp_path / "run" / "checkpoint-2", tmp_path / "export"
    out.mkdir()
    (out / ".model.safetensors.tmp-123").write_bytes(b"half a file")  # a killed export's
    (out / ".config.json.tmp-7").write_text("{")
    export_weights(ckpt, out)
    assert (out / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    export_weights(ckpt, out)  # again, over the earlier export and the leftovers
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "hparams.json", "config.json"}
    # a file no export writes is still refused
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ll.CheckpointError, match=r"holds files that no export wrote \(notes\.txt\)"):
        export_weights(ckpt, out)


def test_async_checkpoint_is_invisible_until_its_on_save(tmp_path):
    """single/DDP with async_save: the background thread fsyncs, checksums and writes the
    manifest; the checkpoint gets its name when committed (at the next save, or the end of the
    fit), right before its on_save. It used to be renamed by the thread: a kill after that and
    before the next save resumed from a checkpoint whose on_save never ran."""
    import threading

    out = tmp_path / "run"
    seen = []

    class Watch(ll.Callback):
        def on_step_end(self, fitter, state, control):
            for t in threading.enumerate():  # the background commit of checkpoint-2 finishes first
                if t.name.startswith("lightlike-commit"):
                    t.join()
            seen.append((state.global_step, [p.name for p in list_checkpoints(out)]))

        def on_save(self, fitter, state, control, path):
            verify_checkpoint(path)
            seen.append((state.global_step, "on_save " + os.path.basename(path)))

    torch.manual_seed(0)
    ll.Fitter(max_steps=5, batch_size=4, save_every=2, async_save=True, output_dir=str(out), loggers=[],
              callbacks=[Watch()]).fit(Classifier(), DictDataset(n=40))
    assert seen == [(1, []), (2, []), (3, []), (4, []), (4, "on_save checkpoint-2"), (5, ["checkpoint-2"]), (5, "on_save checkpoint-4"), (5, "on_save checkpoint-5")], seen


def test_a_fit_that_fails_commits_the_async_checkpoint_it_had_written(tmp_path):
    """async_save on single/DDP: checkpoint-6 was written and being sealed in the background when
    step 7 raised; the rename waits for the next save, so the failure lost it (the resume went
    back to step 3). Its files were all written: the failing fit commits it (no on_save)."""
    out = tmp_path / "run"
    saved = []

    class FailAt7(ll.Callback):
        def on_step_start(self, fitter, state, control):
            if state.global_step == 6:
                raise RuntimeError("boom at step 7")

        def on_save(self, fitter, state, control, path):
            saved.append(os.path.basename(path))

    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="boom"):
        ll.Fitter(max_steps=9, batch_size=4, save_every=3, async_save=True, output_dir=str(out), loggers=[],
                  callbacks=[FailAt7()]).fit(Classifier(), DictDataset(n=40))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-6"]
    assert saved == ["checkpoint-3"]
    verify_checkpoint(out / "checkpoint-6")
    assert not [p for p in out.iterdir() if p.name.startswith(".checkpoint-")]
    fitter = ll.Fitter(max_steps=9, batch_size=4, save_every=3, async_save=True, output_dir=str(out), loggers=[])
    assert fitter.fit(Classifier(), DictDataset(n=40), resume=True).global_step == 9
    assert os.path.basename(fitter.resumed_from) == "checkpoint-6"


@pytest.mark.parametrize("damaged, where", [("optimizer.pt", "head"), ("trainer_state.json", "head"),
                                            ("model.safetensors", "head"), ("model.safetensors", "tail"),
                                            ("optimizer.pt", "tail")])
def test_a_resume_reads_while_it_verifies_and_sets_nothing_from_a_damaged_file(tmp_path, damaged, where):
    """The checksums run while the files are read (``start_verifying``): a damaged file is
    reported as the changed file it is, even where reading it fails first (its format's first
    bytes overwritten), and nothing of the checkpoint reaches the module, also where the file
    reads as other numbers (its last tensor's bytes flipped)."""
    train(tmp_path, steps=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    target = ckpt / damaged
    data = bytearray(target.read_bytes())
    at = range(8) if where == "head" else range(len(data) - 40, len(data) - 32)
    for i in at:
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    torch.manual_seed(1)
    model = Classifier()
    before = flat_params(model).clone()
    fitter = ll.Fitter(max_steps=6, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[])
    with pytest.raises(ll.CheckpointError, match=f"file {damaged} has changed contents"):
        fitter.fit(model, DictDataset(n=40), resume=str(ckpt))
    assert torch.equal(flat_params(model), before)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(state=5), "state is 5"),
    (lambda d: d["state"].update(global_step=-7), "global_step is -7, not an integer >= 0"),
    (lambda d: d["state"].update(samples_in_epoch="12"), "samples_in_epoch is '12'"),
    (lambda d: d["state"].update(epoch=float("nan")), "epoch is nan, not a finite number"),
    (lambda d: d["state"].update(log_history={"step": 1}), "log_history"),
    (lambda d: d.update(batches_in_epoch_per_rank=[3, 3]), "batches_in_epoch_per_rank is \\[3, 3\\], not a list of 1"),
    (lambda d: d.update(loss_total="x"), "loss_total is 'x'"),
    (lambda d: d.pop("world_size") and d.update(pending_per_rank=None), "world_size is None"),
])
def test_a_hand_edited_trainer_state_is_refused_naming_the_file_and_the_field(tmp_path, edit, field):
    """``trainer_state.json`` edited and the manifest re-sealed: ``{"state": 5}`` was an
    AttributeError naming no file, ``global_step=-7`` trained on. Each is one CheckpointError
    naming the file and the field, before anything is restored."""
    from lightlike.checkpoint.manifest import CHECKSUM, file_hash

    train(tmp_path, steps=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    file = ckpt / "trainer_state.json"
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"size": file.stat().st_size, CHECKSUM: file_hash(file)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    torch.manual_seed(1)
    model = Classifier()
    before = flat_params(model).clone()
    with pytest.raises(ll.CheckpointError, match=f"trainer_state.json: {field}"):
        ll.Fitter(max_steps=6, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[]).fit(
            model, DictDataset(n=40), resume=str(ckpt))
    assert torch.equal(flat_params(model), before)
    if "per_rank" not in field and "loss_total" not in field and "world_size" not in field:
        with pytest.raises(ll.CheckpointError, match=f"trainer_state.json: {field}"):
            ll.FitState.saved_in(ckpt)  # the state alone, as callbacks and tools read it


@pytest.mark.parametrize("file, edit, says", [
    ("scheduler.pt", lambda d: d.update(last_epoch=-7), r"scheduler.pt: last_epoch is -7"),
    ("scheduler.pt", lambda d: 5, r"scheduler.pt: holds a int"),
    ("rng.pt", lambda d: [{"torch": "x"}], r"rng.pt \(rng\) could not be restored"),
    ("precision.pt", lambda d: [1, 2], r"precision.pt \(precision\) could not be restored"),
])
def test_a_hand_edited_state_file_is_refused_naming_it(tmp_path, file, edit, says):
    """The other state files, re-sealed after an edit: refused by name (the scheduler's step
    count is checked; torch's load_state_dict takes any dict), not torch's bare error or a
    scheduler that goes on from step -7."""
    from lightlike.checkpoint.manifest import CHECKSUM, file_hash

    train(tmp_path, steps=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    data = torch.load(ckpt / file, weights_only=True)
    edited = edit(data)
    torch.save(data if edited is None else edited, ckpt / file)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][file] = {"size": (ckpt / file).stat().st_size, CHECKSUM: file_hash(ckpt / file)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ll.CheckpointError, match=says):
        ll.Fitter(max_steps=6, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[]).fit(
            Classifier(), DictDataset(n=40), resume=str(ckpt))


def test_the_scheduler_check_takes_every_scheduler_state_lightlike_writes(tmp_path):
    """``check_scheduler_state``: torch's state (a step count >= 0), a manual module's several
    (None for an optimizer without a scheduler), and a user's scheduler without ``last_epoch``
    pass; a negative or missing count where torch's state has one, or a non-dict, is refused."""
    from lightlike.checkpoint.registry import check_scheduler_state

    for good in ({"last_epoch": 3, "base_lrs": [0.1]}, {"schedulers": [None, {"last_epoch": 0}]}, {"step": 7}):
        check_scheduler_state(good, tmp_path / "scheduler.pt")
    for bad in ({"last_epoch": -1}, {"schedulers": [{"last_epoch": "2"}]}, {"schedulers": [5]}, [1, 2], None):
        with pytest.raises(ll.CheckpointError, match="scheduler.pt: "):
            check_scheduler_state(bad, tmp_path / "scheduler.pt")

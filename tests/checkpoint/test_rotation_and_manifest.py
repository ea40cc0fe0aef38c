"""Rotation, manifest and resume choices (mutation round BD)."""

from __future__ import annotations

import contextlib
import datetime
import json
import zlib
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset, StopAt

import lightlike as ll
from lightlike.checkpoint import atomic
from lightlike.checkpoint import manifest as mf
from lightlike.checkpoint import resume as rs
from lightlike.checkpoint import rotation as rot
from lightlike.errors import CheckpointError


def make_ckpt(out: Path, step: int, payload: bytes = b"weights", meta: dict | None = None) -> Path:
    """A minimal committed checkpoint: one file and a manifest listing it."""
    p = out / f"checkpoint-{step}"
    p.mkdir(parents=True)
    (p / "model.bin").write_bytes(payload)
    man = {"format": mf.FORMAT, "version": mf.VERSION,
           "files": {"model.bin": {"size": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}}}
    if meta is not None:
        man["meta"] = meta
    (p / mf.MANIFEST).write_text(json.dumps(man))
    return p


# -- rotation.py ---------------------------------------------------------------------------------
def test_rotation_removes_the_manifest_before_the_files(tmp_path, monkeypatch):
    """A kill mid-delete must leave a directory that is not a checkpoint: the manifest goes first
    (here the tree removal itself never happens, as if killed right after the unlink)."""
    for s in (1, 2, 3):
        make_ckpt(tmp_path, s)
    monkeypatch.setattr(rot.shutil, "rmtree", lambda *a, **k: None)
    deleted = rot.rotate_checkpoints(tmp_path, limit=1)
    assert [p.name for p in deleted] == ["checkpoint-1", "checkpoint-2"]
    assert [p.name for p in mf.list_checkpoints(tmp_path)] == ["checkpoint-3"]
    assert mf.find_latest_valid(tmp_path) == tmp_path / "checkpoint-3"


def test_resume_auto_with_overwrite_removes_what_lightlike_wrote_and_sets_the_rest_aside(tmp_path):
    """resume='auto' that found nothing valid, with overwrite_output_dir=True: lightlike's own log
    files are removed (overwrite says so), not moved into abandoned-*; a checkpoint-3 without a
    manifest, which lightlike cannot prove it wrote, is moved into set-aside-*, never deleted."""
    broken = tmp_path / "checkpoint-3"
    broken.mkdir()
    (broken / "model.bin").write_bytes(b"x")  # no manifest: not valid
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text("step,name,value\n")
    rot.prepare_output_dir(tmp_path, overwrite=True, resume="auto")
    [aside] = list(tmp_path.iterdir())
    assert aside.name.startswith("set-aside-") and (aside / "checkpoint-3" / "model.bin").read_bytes() == b"x"


# -- manifest.py ---------------------------------------------------------------------------------
def test_an_extended_file_is_refused_even_without_checksums(tmp_path):
    p = make_ckpt(tmp_path, 2)
    with open(p / "model.bin", "ab") as f:
        f.write(b"more")
    with pytest.raises(CheckpointError, match="truncated or extended"):
        mf.verify_checkpoint(p, hashes=False)


def test_latest_valid_is_by_step_number_not_by_name(tmp_path):
    for s in (9, 10):
        make_ckpt(tmp_path, s)
    assert mf.find_latest_valid(tmp_path) == tmp_path / "checkpoint-10"
    assert mf.find_latest_valid(tmp_path, hashes=False, resumable=True) == tmp_path / "checkpoint-10"


def test_a_checkpoint_that_vanishes_while_verified_is_skipped(tmp_path, monkeypatch):
    """OSError (moved away by the main rank meanwhile) skips to an older checkpoint with a warning."""
    make_ckpt(tmp_path, 1)
    make_ckpt(tmp_path, 2)
    real = mf.verify_checkpoint

    def flaky(p, hashes=True):
        if Path(p).name == "checkpoint-2":
            raise FileNotFoundError(f"{p}/model.bin")
        return real(p, hashes=hashes)

    monkeypatch.setattr(mf, "verify_checkpoint", flaky)
    with pytest.warns(UserWarning, match="skipping invalid checkpoint"):
        assert mf.find_latest_valid(tmp_path) == tmp_path / "checkpoint-1"


# -- resume.py -----------------------------------------------------------------------------------
def test_resume_without_verify_hashes_reads_no_checksum(tmp_path, monkeypatch):
    make_ckpt(tmp_path, 4)

    def no(*a, **k):
        raise AssertionError("checksums computed although verify_hashes=False")

    monkeypatch.setattr(mf, "hash_files", no)
    cfg = ll.FitConfig(output_dir=str(tmp_path), verify_hashes=False)
    assert rs.resolve_resume(cfg, True) == tmp_path / "checkpoint-4"
    assert rs.resolve_resume(cfg, "auto") == tmp_path / "checkpoint-4"


def test_two_set_asides_in_one_second_get_two_folders(tmp_path, monkeypatch):
    fixed = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return fixed

    monkeypatch.setattr(atomic.datetime, "datetime", Frozen)
    make_ckpt(tmp_path, 1)
    make_ckpt(tmp_path, 2)
    first = rs.set_aside(tmp_path, [tmp_path / "checkpoint-1"])
    second = rs.set_aside(tmp_path, [tmp_path / "checkpoint-2"])
    assert first != second
    assert (first / "checkpoint-1").is_dir() and (second / "checkpoint-2").is_dir()
    assert first.name == "abandoned-20300102T030405Z" and second.name == "abandoned-20300102T030405Z-2"


def test_the_best_is_gone_when_its_manifest_is_gone(tmp_path):
    """A best checkpoint whose directory is left without its manifest (a rotation killed after
    the unlink) is no longer there: load_best_at_end must not load from it."""
    p = make_ckpt(tmp_path, 4)
    assert rs.resolve_best(tmp_path, "checkpoint-4", 4) == str(p)
    (p / mf.MANIFEST).unlink()
    assert rs.resolve_best(tmp_path, "checkpoint-4", 4) is None


def _killed_after(step, module_cls, **kw):
    with contextlib.suppress(KeyboardInterrupt):
        ll.Fitter(callbacks=[StopAt(step)], **kw).fit(module_cls(), DictDataset(n=40))


def test_a_changed_sgd_momentum_is_applied_on_resume(tmp_path):
    cfg = dict(max_steps=4, batch_size=4, save_every=2, output_dir=str(tmp_path / "run"), loggers=[],
               optimizer="sgd", model_summary=False)
    torch.manual_seed(0)
    _killed_after(3, Classifier, momentum=0.9, **cfg)
    fitter = ll.Fitter(momentum=0.5, **cfg)
    fitter.fit(Classifier(), DictDataset(n=40), resume=True)
    assert [g["momentum"] for g in fitter.optimizer.param_groups] == [0.5] * len(fitter.optimizer.param_groups)


def test_a_module_with_its_own_optimizer_may_change_the_config_optimizer(tmp_path):
    """configure_optimizers of the module's own: the config's optimizer name is not what built it,
    so a change of it is no reason to refuse the resume."""

    class Custom(Classifier):
        def configure_optimizers(self, config):
            return torch.optim.SGD(self.parameters(), lr=config.learning_rate)

    cfg = dict(max_steps=4, batch_size=4, save_every=2, output_dir=str(tmp_path / "run"), loggers=[],
               model_summary=False, log_level="error")
    _killed_after(3, Custom, optimizer="adamw", **cfg)
    result = ll.Fitter(optimizer="sgd", **cfg).fit(Custom(), DictDataset(n=40), resume=True)
    assert result.global_step == 4


def test_a_changed_learning_rate_is_what_the_scheduler_reports_before_the_first_resumed_step(tmp_path):
    """get_last_lr() (what a callback sees in on_fit_start / on_step_start) and the groups'
    initial_lr follow the new learning_rate from the resume on, not after the first step."""
    seen = {}

    class Look(ll.Callback):
        def on_fit_start(self, fitter, state, control):
            seen["last_lr"] = fitter.scheduler.get_last_lr()
            seen["initial_lr"] = [g["initial_lr"] for g in fitter.optimizer.param_groups]
            seen["lr"] = [g["lr"] for g in fitter.optimizer.param_groups]

    cfg = dict(max_steps=8, batch_size=4, save_every=4, output_dir=str(tmp_path / "run"), loggers=[],
               optimizer="sgd", weight_decay=0.0, model_summary=False, log_level="error")
    torch.manual_seed(0)
    _killed_after(5, Classifier, learning_rate=1e-2, **cfg)
    ll.Fitter(callbacks=[Look()], learning_rate=1e-4, **cfg).fit(Classifier(), DictDataset(n=40), resume=True)
    expected = 1e-4 * (8 - 4) / 8  # linear schedule, next step is step 5
    assert seen["lr"] == [pytest.approx(expected, rel=1e-12)]
    assert seen["last_lr"] == seen["lr"]
    assert seen["initial_lr"] == [1e-4]

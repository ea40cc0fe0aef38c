"""``lightlike export`` never writes into another checkpoint (or over files no export wrote), says
"replaced" only of what an earlier export left, and a sharded (FSDP/DCP) checkpoint of other
shapes is refused with one ``CheckpointError`` listing every misfit, as on one process."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from helpers import Classifier, DictDataset
from launching import launch

import lightlike as ll
from lightlike.checkpoint.manifest import find_latest_valid, verify_checkpoint
from lightlike.cli import main as cli_main

EXPORTED = ["config.json", "hparams.json", "model.safetensors"]


def train(out, steps=4):
    torch.manual_seed(0)
    ll.Fitter(max_steps=steps, batch_size=4, save_every=2, output_dir=str(out), loggers=[]).fit(
        Classifier(), DictDataset(n=16))
    return out


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# -- defect 1: OUT_DIR is another checkpoint, or holds what no export wrote ------------------------
def test_export_refuses_another_checkpoint_and_foreign_files(tmp_path, capsys, caplog):
    run = train(tmp_path / "run")
    ck2, ck4 = run / "checkpoint-2", run / "checkpoint-4"
    before = snapshot(ck2)
    assert cli_main(["export", str(ck4), str(ck2)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(ck2) in err and "is a checkpoint" in err and "choose a new or empty OUT_DIR" in err
    assert snapshot(ck2) == before  # nothing written
    verify_checkpoint(ck2)  # still valid (crc included)
    # into the source itself: allowed, leaves it as it was, and nothing is called "replaced"
    before = snapshot(ck4)
    with caplog.at_level("WARNING", logger="lightlike"):
        assert cli_main(["export", str(ck4), str(ck4)]) == 0
    assert snapshot(ck4) == before and "replaced" not in caplog.text
    verify_checkpoint(ck4)
    assert find_latest_valid(run, resumable=True) == ck4
    # a folder holding files that no export wrote: refused, nothing touched
    other = tmp_path / "mine"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"not an export's")
    (other / "notes.txt").write_text("mine")
    assert cli_main(["export", str(ck4), str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(other) in err and "notes.txt" in err
    assert snapshot(other) == {"model.safetensors": b"not an export's", "notes.txt": b"mine"}
    # a file as OUT_DIR: the same kind of one-line error, not a traceback
    assert cli_main(["export", str(ck4), str(other / "notes.txt")]) == 2
    assert "is a file" in capsys.readouterr().err
    # an earlier export is still replaced, with a warning naming what was replaced
    out = tmp_path / "export"
    assert cli_main(["export", str(ck2), str(out)]) == 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightlike"):
        assert cli_main(["export", str(ck4), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == EXPORTED
    assert "replaced model.safetensors, hparams.json, config.json" in caplog.text


# -- defects 2 and 3: a sharded (FSDP, DCP) checkpoint ---------------------------------------------
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """2 processes, FSDP, width 16, a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    p = launch(2, out, "--strategy", "fsdp", "--steps", "2", "--save-every", "2", "--items", "16", timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return out


def test_export_of_sharded_checkpoint_into_new_folder_replaces_nothing(fsdp_run, tmp_path, caplog):
    ck = fsdp_run / "checkpoint-2"
    assert not (ck / "model.safetensors").exists()  # sharded: consolidated by the export
    out = tmp_path / "new"
    with caplog.at_level("WARNING", logger="lightlike"):
        ll.checkpoint.export_weights(ck, out)
    assert sorted(p.name for p in out.iterdir()) == EXPORTED
    assert "replaced" not in caplog.text
    fresh = Classifier(**json.loads((out / "hparams.json").read_text())).double()
    fresh.load_weights(out)
    final = torch.load(fsdp_run / "final-rank0.pt", weights_only=True)
    assert all(torch.equal(v, final[k]) for k, v in fresh.state_dict().items())
    # again into the same folder: now an earlier export's files are replaced, and said so
    with caplog.at_level("WARNING", logger="lightlike"):
        ll.checkpoint.export_weights(ck, out)
    assert "replaced model.safetensors, hparams.json, config.json" in caplog.text
    # into another checkpoint: refused before anything is consolidated
    other = tmp_path / "copy"
    shutil.copytree(ck, other)
    before = snapshot(other)
    with pytest.raises(ll.CheckpointError, match="is a checkpoint"):
        ll.checkpoint.export_weights(ck, other)
    assert snapshot(other) == before
    # into itself: a model.safetensors its manifest does not list would make it unloadable
    with pytest.raises(ll.CheckpointError, match="is sharded .*export it into another folder"):
        ll.checkpoint.export_weights(other, other)
    assert snapshot(other) == before


def test_fsdp_resume_with_other_shapes_lists_every_mismatch(fsdp_run, tmp_path):
    ck = fsdp_run / "checkpoint-2"
    p = launch(2, tmp_path / "wide", "--strategy", "fsdp", "--steps", "4", "--items", "16", "--width", "32",
               "--resume", str(ck), timeout=120)
    assert p.returncode != 0
    err = p.stderr
    assert "CheckpointException" not in err, err[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank} of 2 failed during set-up at step 0: CheckpointError: the weights from {ck} "
                "do not fit Classifier:") in err, err[-3000:]
    assert ("3 shape mismatches: net.0.weight: checkpoint (16, 8) vs module (32, 8), net.0.bias: checkpoint (16,) "
            "vs module (32,), net.2.weight: checkpoint (3, 16) vs module (3, 32)") in err


def test_dcp_load_lists_misfits_and_wraps_checkpoint_exception(tmp_path, monkeypatch):
    """One process, no process group: the same listing as ``check_fits``, from DCP's metadata;
    and DCP's own ``CheckpointException`` (a BaseException) becomes a CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lightlike.checkpoint.dcp import load_dcp_state, save_dcp_state

    class Extra(Classifier):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.head = torch.nn.Linear(2, 2)

    directory, plain = tmp_path / "checkpoint-1" / "dcp", tmp_path / "checkpoint-2" / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, so one process
        save_dcp_state(directory, Extra(), None)
        save_dcp_state(plain, Classifier(), None)
    wide = Classifier(width=32)
    with pytest.raises(ll.CheckpointError) as info:
        load_dcp_state(directory, wide, None)
    msg = str(info.value)
    assert msg.startswith(f"the weights from {directory.parent} do not fit Classifier:\n")
    assert "2 unexpected keys (in the checkpoint, not in the module): head.weight, head.bias" in msg
    assert "3 shape mismatches: net.0.weight: checkpoint (16, 8) vs module (32, 8)" in msg
    with pytest.raises(ll.CheckpointError, match=r"2 missing keys \(in the module, not in the checkpoint\): head.weight"):
        load_dcp_state(plain, Extra(), None)

    def failing(*args, **kwargs):
        raise CheckpointException("failed", {0: (OSError(5, "Input/output error"), None)})

    monkeypatch.setattr(dcp, "load", failing)
    with pytest.raises(ll.CheckpointError, match=r"could not be loaded into Extra: rank 0: OSError: .*Input/output"):
        load_dcp_state(directory, Extra(), None)

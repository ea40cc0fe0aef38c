"""Corners of ``lightlike export`` and of the command line around it: damaged manifests and
export folders, a re-export that fails part-way, where predictions go, what hparams.json and
``lightlike config`` write and read back, and the hints for a misspelt config-file key. A user
error is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Classifier
from launching import FSDP_ARGS
from test_cli import cli
from test_cli_surface import one_line_error, run_cli

import lightlike as ll
from lightlike.checkpoint import CheckpointWriter, find_latest_valid, list_checkpoints, verify_checkpoint
from lightlike.checkpoint.export import export_weights

ROOT = Path(__file__).resolve().parents[2]
TARGET = f"{ROOT / 'examples' / 'cli_module.py'}:Classifier"
HELPERS_CLASSIFIER = f"{ROOT / 'tests' / 'helpers.py'}:Classifier"
SMALL = ["--loggers", "[]", "--model_summary", "false", "--model.train_items", "32", "--model.val_items", "16"]


def _sharded_run(shared_run) -> Path:
    """test_fsdp's 2-process FSDP run (checkpoints of DCP shards, no model.safetensors)."""
    run = shared_run(2, "--strategy", "fsdp", *FSDP_ARGS)
    newest = list_checkpoints(run)[-1]
    assert (newest / "dcp").is_dir() and not (newest / "model.safetensors").exists()
    return run


def _full_checkpoint(root: Path, step: int, width: int) -> Path:
    """A full checkpoint of tests/helpers.py's Classifier with ``width`` hidden units."""
    module = Classifier(width=width)
    with CheckpointWriter(root, step, meta={"kind": "full", "state_format": "full"}) as w:
        w.save_safetensors("model.safetensors", {k: v.contiguous() for k, v in module.state_dict().items()})
        w.write_json("hparams.json", dict(module.hparams))
        w.write_json("config.json", {"step": step})
    return root / f"checkpoint-{step}"


# -- 1: a sharded checkpoint is not its own export folder ----------------------------------------
def test_exporting_a_sharded_checkpoint_into_itself_is_refused_as_the_docs_say(shared_run, tmp_path, capsys):
    """`lightlike export CKPT CKPT` on an FSDP checkpoint: one line saying to export elsewhere,
    the checkpoint untouched, and docs/checkpoints.md no longer promises it "gains" the weights."""
    ckpt = tmp_path / "checkpoint-9"
    shutil.copytree(list_checkpoints(_sharded_run(shared_run))[-1], ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    line = one_line_error(capsys, "export", str(ckpt), str(ckpt))
    assert "is sharded" in line and "another folder" in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == before
    verify_checkpoint(ckpt)  # still loads
    docs = " ".join((ROOT / "docs" / "checkpoints.md").read_text().split())
    assert "gains the consolidated" not in docs
    assert "a sharded `CHECKPOINT_DIR` itself" in docs


# -- 2: a manifest that parses but is damaged -----------------------------------------------------
@pytest.mark.parametrize("damage", ["meta_null", "files_list", "entry_without_size"])
def test_a_manifest_of_the_wrong_structure_is_one_clear_error_and_skipped_on_resume(shared_run, tmp_path,
                                                                                  capsys, damage):
    """A manifest.json that is valid JSON but not shaped as lightlike writes it ("meta": null,
    "files" a list, an entry without "size"): `export` and `validate --checkpoint` say "not a
    lightlike manifest" in one line, and the newest-valid search skips it (no traceback)."""
    run = tmp_path / "run"
    run.mkdir()
    older, newest = list_checkpoints(_sharded_run(shared_run))[-2:]
    for ckpt in (older, newest):
        shutil.copytree(ckpt, run / ckpt.name)
    mpath = run / newest.name / "manifest.json"
    m = json.loads(mpath.read_text())
    if damage == "meta_null":
        m["meta"] = None
    elif damage == "files_list":
        m["files"] = sorted(m["files"])
    else:
        next(iter(m["files"].values())).pop("size")
    mpath.write_text(json.dumps(m))

    line = one_line_error(capsys, "export", str(run / newest.name), str(tmp_path / "out"))
    assert "manifest.json is unreadable or not a lightlike manifest" in line, line
    assert not (tmp_path / "out").exists()
    line = one_line_error(capsys, "validate", HELPERS_CLASSIFIER, "--checkpoint", str(run / newest.name),
                          "--loggers", "[]", "--output_dir", str(tmp_path / "v"))
    assert "not a lightlike manifest" in line, line
    with pytest.warns(UserWarning, match="skipping invalid checkpoint"):
        assert find_latest_valid(run, hashes=False) == run / older.name


# -- 3: an export folder whose weights were cut short ---------------------------------------------
def test_validate_on_an_export_whose_model_file_was_cut_short_names_the_file(tmp_path, capsys):
    """`validate --checkpoint EXPORT` where model.safetensors was truncated (an interrupted copy):
    one line naming the file, exit 2, not a safetensors traceback with exit 1."""
    exp = tmp_path / "exp"
    export_weights(_full_checkpoint(tmp_path / "run", 1, 16), exp)
    f = exp / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    line = one_line_error(capsys, "validate", HELPERS_CLASSIFIER, "--checkpoint", str(exp), "--loggers", "[]",
                          "--output_dir", str(tmp_path / "v"))
    assert str(f) in line and "not a readable safetensors file" in line, line


# -- 4: a re-export that fails part-way ------------------------------------------------------------
def test_a_re_export_that_fails_part_way_leaves_the_earlier_export_whole(tmp_path, monkeypatch):
    """Re-exporting a width-32 checkpoint over a width-16 export, with hparams.json failing to copy
    (a full disk): the export raises and the folder still holds the width-16 export, all of it
    (never the new weights beside the old hparams.json), and no temp file."""
    from safetensors.torch import load_file

    out = tmp_path / "export"
    export_weights(_full_checkpoint(tmp_path / "a", 1, 16), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    b = _full_checkpoint(tmp_path / "b", 2, 32)
    real = shutil.copyfile

    def failing(src, dst, *a, **k):
        if str(src).endswith("hparams.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(shutil, "copyfile", failing)
    with pytest.raises(OSError, match="No space left"):
        export_weights(b, out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert load_file(str(out / "model.safetensors"))["net.0.weight"].shape[0] == 16
    export_weights(b, out)  # and the retry replaces all of it
    assert json.loads((out / "hparams.json").read_text())["width"] == 32
    assert load_file(str(out / "model.safetensors"))["net.0.weight"].shape[0] == 32


# -- 5: where predictions go --------------------------------------------------------------------
@pytest.mark.parametrize("case", ["predictions_file_is_a_directory", "predictions_file_under_a_file",
                                  "output_dir_is_a_file"])
def test_an_unwritable_predictions_path_is_one_clear_error_before_predicting(tmp_path, capsys, monkeypatch, case):
    """`predict` whose predictions cannot be written (--predictions_file naming a directory or a
    path under a file, an --output_dir that is a file): one line, exit 2, before anything is
    predicted (not a traceback after the whole prediction), and no stray temp file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ll.Fitter, "predict", lambda *a, **k: pytest.fail("predicted before checking the path"))
    if case == "predictions_file_is_a_directory":
        Path("preds").mkdir()
        extra = ["--output_dir", "out", "--predictions_file", "preds"]
    elif case == "predictions_file_under_a_file":
        Path("notes.txt").write_text("x")
        extra = ["--output_dir", "out", "--predictions_file", "notes.txt/p.pt"]
    else:
        Path("out").write_text("x")
        extra = ["--output_dir", "out"]
    line = one_line_error(capsys, "predict", TARGET, *SMALL, *extra)
    assert {"predictions_file_is_a_directory": "is a directory", "predictions_file_under_a_file":
            "'notes.txt' is a file", "output_dir_is_a_file": "output_dir 'out' is a file"}[case] in line, line
    assert [p.name for p in tmp_path.rglob(".*")] == []


def test_a_predictions_file_that_fails_to_land_leaves_no_temp_file(tmp_path, monkeypatch):
    """A write of the predictions that fails at the rename (a full disk, a path that became a
    directory) raises, and leaves no `.NAME.tmp-PID` file beside it."""
    import os

    from lightlike.cli import _write_predictions
    from lightlike.state import PredictionResult

    def failing(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", failing)
    result = PredictionResult(predictions=torch.zeros(2), labels=None, metrics={})
    with pytest.raises(OSError, match="No space left"):
        _write_predictions(tmp_path / "p.pt", result)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


# -- 6: hparams.json with paths and enums ---------------------------------------------------------
PATH_ENUM_MODULE = '''
import enum, json
from pathlib import Path
import torch
from torch import nn
import lightlike as ll

class Mode(enum.Enum):
    SMALL = "small"
    LARGE = "large"

class PathModule(ll.TaskModule):
    def __init__(self, data_dir: Path = Path("data"), mode: Mode = Mode.SMALL, tags: frozenset[str] = frozenset({"b", "a"}),
                 width: int = 4):
        super().__init__()
        self.save_hyperparameters()
        with open("record.jsonl", "a") as f:   # what the constructor was given
            f.write(json.dumps({"data_dir": repr(data_dir), "mode": repr(mode)}) + "\\n")
        self.data_dir = Path(data_dir)
        self.net = nn.Linear(2, width)

    def val_data(self):
        x = torch.load(self.data_dir / "x.pt")
        return [{"x": x[i], "y": torch.tensor(i % 2)} for i in range(len(x))]

    train_data = val_data

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, out, batch):
        return nn.functional.cross_entropy(out, batch["y"])
'''


def test_validate_rebuilds_a_module_with_the_path_and_enum_it_was_trained_with(tmp_path):
    """A module taking a Path and an Enum: hparams.json holds "data", "small" and a set as a list
    (not "PosixPath('data')" / "<Mode.SMALL: 'small'>"), and `validate --checkpoint` gives the
    constructor the same Path and Enum member the fit did."""
    (tmp_path / "corners_pathmodule.py").write_text(PATH_ENUM_MODULE)
    (tmp_path / "data").mkdir()
    torch.save(torch.randn(8, 2), tmp_path / "data" / "x.pt")
    target = "corners_pathmodule.py:PathModule"
    cli("fit", target, "--max_steps", "1", "--save_every", "1", "--output_dir", "run", "--loggers", "[]",
        "--batch_size", "4", "--model_summary", "false", cwd=tmp_path)
    saved = json.loads((tmp_path / "run" / "checkpoint-1" / "hparams.json").read_text())
    assert saved == {"data_dir": "data", "mode": "small", "tags": ["a", "b"], "width": 4}
    cli("validate", target, "--checkpoint", "run", "--loggers", "[]", "--output_dir", "v", "--batch_size", "4",
        cwd=tmp_path)
    fit, validate = (json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines())
    assert validate == fit == {"data_dir": "PosixPath('data')", "mode": "<Mode.SMALL: 'small'>"}


# -- 7, 8: what `lightlike config` writes reads back ----------------------------------------------
SET_MODULE = '''
from torch import nn
import lightlike as ll

class Tagged(ll.TaskModule):
    def __init__(self, tags: set[str] = frozenset({"a"}), ids: frozenset[int] = frozenset({2, 1})):
        super().__init__()
        self.net = nn.Linear(2, 2)

    def forward(self, batch):
        return self.net(batch["x"])
'''

NO_ARGS_MODULE = '''
from torch import nn
import lightlike as ll

class NoArgs(ll.TaskModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 2)

    def forward(self, batch):
        return self.net(batch["x"])
'''


def test_json_config_of_a_set_argument_reads_back_as_the_same_set(tmp_path, capsys, monkeypatch):
    """`lightlike config --format json` writes a set default as a list ([1, 2]), not as its repr
    ("frozenset({1, 2})"), which `--config` read back as the list ["frozenset({1", "2})"]."""
    monkeypatch.chdir(tmp_path)
    Path("corners_tagged.py").write_text(SET_MODULE)
    code, out, err = run_cli(capsys, "config", "corners_tagged.py:Tagged", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["model"] == {"tags": ["a"], "ids": [1, 2]}
    Path("c.json").write_text(out)
    code, back, err = run_cli(capsys, "config", "corners_tagged.py:Tagged", "--config", "c.json", "--format", "json")
    assert code == 0, err
    assert back == out


def test_yaml_config_of_a_module_without_constructor_arguments_reads_back(tmp_path, capsys, monkeypatch):
    """`--format yaml` for a module without constructor arguments writes `model: {}` (a bare
    `model:` is YAML's null, which `--config` refused as "got None"); a bare one reads too."""
    pytest.importorskip("yaml")
    monkeypatch.chdir(tmp_path)
    Path("corners_noargs.py").write_text(NO_ARGS_MODULE)
    code, out, err = run_cli(capsys, "config", "corners_noargs.py:NoArgs", "--format", "yaml")
    assert code == 0, err
    assert out.endswith("\nmodel: {}\n"), out
    Path("c.yaml").write_text(out)
    code, back, err = run_cli(capsys, "config", "corners_noargs.py:NoArgs", "--config", "c.yaml", "--format", "yaml")
    assert code == 0, err
    assert back == out
    Path("bare.yaml").write_text("max_steps: 3\nmodel:\n")
    code, back, err = run_cli(capsys, "config", "corners_noargs.py:NoArgs", "--config", "bare.yaml", "--format", "yaml")
    assert code == 0, err
    assert "max_steps: 3\n" in back


# -- 9: --loggers null ----------------------------------------------------------------------------
def test_loggers_null_means_no_loggers_as_none_does(tmp_path, capsys):
    """docs/cli.md: None is `none` or `null`. `--loggers null` runs with no loggers, as
    `--loggers none` does, instead of "unknown logger 'null'"."""
    args = ["--max_steps", "1", "--model_summary", "false", "--model.train_items", "16", "--model.val_items", "8"]
    for word in ("none", "null"):
        code, _, err = run_cli(capsys, "fit", TARGET, *args, "--output_dir", str(tmp_path / word), "--loggers", word)
        assert code == 0, err
        assert not (tmp_path / word / "logs").exists()


# -- 10: a misspelt constructor argument at the top level of a config file ------------------------
@pytest.mark.parametrize(("text", "want"), [("widht = 64", "model.width"), ("dropuot = 0.1", "model.dropout")])
def test_a_misspelt_constructor_argument_at_the_top_of_a_config_file_names_the_model_key(tmp_path, capsys,
                                                                                       monkeypatch, text, want):
    """`widht = 64` at the top level of run.toml is answered with "did you mean 'model.width'?"
    (as the flag --widht is), not with no hint, and `dropuot` is not pointed at 'drop_last'."""
    monkeypatch.chdir(tmp_path)
    Path("run.toml").write_text(f"max_steps = 5\n{text}\n")
    line = one_line_error(capsys, "config", TARGET, "--config", "run.toml")
    assert f"(did you mean {want!r}? constructor arguments go in the 'model' table)" in line, line
    assert "drop_last" not in line
    Path("ok.toml").write_text("max_steps = 5\nmax_step = 5\n")  # a run setting is still named as one
    assert "did you mean 'max_steps'?" in one_line_error(capsys, "config", TARGET, "--config", "ok.toml")


def test_hparams_json_values_json_has_no_form_for_are_written_by_value():
    """hparams.json writes a Path as its text, an Enum by value, a set as a sorted list (also
    inside lists and dicts), not as their reprs."""
    import enum

    from lightlike.checkpoint.training import jsonable

    class Size(enum.Enum):
        S = 1

    got = jsonable({"p": Path("a/b"), "e": Size.S, "s": {3, 1}, "nested": [Path("c"), {"k": Size.S}], "n": 2})
    assert json.loads(json.dumps(got)) == {"p": "a/b", "e": 1, "s": [1, 3], "nested": ["c", {"k": 1}], "n": 2}

"""More of the command line's surface (audit AO's mutation round): help output, top-level
exits, config-file loading errors, constructor-argument precedence with a checkpoint's
hparams.json, data factories and their errors, eval data fallbacks and predictions as JSON.
Driven through ``lightlike.cli.main`` in process, against the Python API or exact known text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli_surface import one_line_error, run_cli

import lightlike as ll
from lightlike.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cli_module.py"
TARGET = f"{EXAMPLE}:Classifier"
SMALL = ["--loggers", "[]", "--model_summary", "false", "--model.train_items", "32", "--model.val_items", "16"]

#: A module without save_hyperparameters and without test_data, a docstring with a percent
#: sign, and one with a required constructor argument.
MODULE = '''
import torch
from torch import nn
import lightlike as ll


def items(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 2)} for i in range(n)]


class Net(ll.TaskModule):
    """A linear classifier.

    Args:
        width: hidden units; 50% of them are dropped at most.
    """

    def __init__(self, width: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))

    def train_data(self):
        return items(16, 0)

    def val_data(self):
        return items(8, 1)

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])

    def metrics(self, outputs, batch):
        return {"loss_sum": nn.functional.cross_entropy(outputs, batch["y"], reduction="sum")}


class Needs(Net):
    def __init__(self, depth: int, width: int = 3):
        super().__init__(width=width)
'''

FACTORIES = '''
import torch


def items(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return [{"x": x[i], "y": torch.tensor(i % 4)} for i in range(n)]


def five():
    return items(8, 0), items(8, 1), items(8, 2), items(8, 3), items(8, 4)


def misspelt():
    return {"train": items(8, 0), "vall": items(8, 1)}


def one():
    return items(12, 7)


def anything(**kw):
    return items(8 * kw["config"].batch_size, 0), None
'''


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("ao_net.py").write_text(MODULE)
    Path("ao_factories.py").write_text(FACTORIES)
    return tmp_path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The example trained for 2 steps through the CLI: checkpoint-2 (val_items 16)."""
    out = tmp_path_factory.mktemp("ao_cli") / "run"
    assert main(["fit", TARGET, "--max_steps", "2", "--save_every", "2", "--output_dir", str(out), *SMALL]) == 0
    return out / "checkpoint-2"


def reference_module(ckpt, **override):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ao_cli_module_ref", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    module = mod.Classifier(**{**json.loads((ckpt / "hparams.json").read_text()), **override})
    module.load_weights(ckpt)
    return mod, module


# -- help and top-level exits -----------------------------------------------------------------
def test_help_shows_a_percent_sign_and_required_arguments(capsys, here):
    """argparse formats help with %: a docstring's '50%' must not break --help."""
    with pytest.raises(SystemExit) as e:
        main(["fit", "ao_net.py:Needs", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "hidden units; 50% of them are dropped at most. (default: 3)" in " ".join(out.split())
    assert "--model.depth INT" in out and "(required)" in out


def test_top_level_help_lists_each_setting_with_its_type_and_default(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for line in ("  max_steps (int | None, default None)", "  batch_size (int, default 8)",
                 "  output_dir (str, default 'runs/lightlike')", "  overwrite_output_dir (bool, default False)"):
        assert line + "\n" in out, line


def test_no_arguments_is_a_usage_error_and_version_names_the_package(capsys):
    code, out, err = run_cli(capsys)
    assert code == 2 and out == "" and err.startswith("usage: lightlike")
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out == f"lightlike {ll.__version__}\n"


def test_an_unknown_command_is_exit_2_with_the_nearest(capsys):
    code, out, err = run_cli(capsys, "fitt", TARGET)
    assert code == 2 and out == ""
    assert err.strip() == ("lightlike: error: unknown command 'fitt' (did you mean 'fit'?); "
                           "commands: fit, validate, test, predict, config, export")


def test_help_still_shows_when_the_target_does_not_load(capsys, here):
    with pytest.raises(SystemExit) as e:
        main(["fit", "nope.py:Net", "--help"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and "--max_steps" in out
    assert "lightlike fit: note: module 'nope.py:Net': no such file 'nope.py'" in err


def test_an_evaluation_without_a_module_is_a_one_line_error(capsys):
    line = one_line_error(capsys, "validate", "--max_steps", "1")
    assert "validate needs the module: lightlike validate MODULE_PATH:ClassName" in line


# -- settings: words, files, argv ---------------------------------------------------------------
def test_config_without_a_stopping_criterion_shows_both_unset(capsys):
    """Only fit needs max_steps or max_epochs: config shows neither set (it used to show a
    max_epochs = 1 that nobody gave), and fit refuses it."""
    code, out, err = run_cli(capsys, "config", TARGET)
    assert code == 0 and err == ""
    assert "# max_epochs = None (unset)\n" in out and "# max_steps = None (unset)\n" in out


def test_none_words_and_bad_json(capsys):
    code, out, err = run_cli(capsys, "config", TARGET, "--max_epochs", "2", "--max_steps", "none",
                             "--eval_every", "null", "--format", "json")
    assert code == 0, err
    got = json.loads(out)
    assert got["max_steps"] is None and got["eval_every"] is None and got["max_epochs"] == 2
    line = one_line_error(capsys, "config", TARGET, "--loggers", "[csv")
    assert "argument --loggers: not valid JSON (" in line and "'[csv'" in line


def test_fractional_max_epochs_on_the_command_line(capsys):
    """--max_epochs takes 2 (an int) or 2.5, and --help says NUMBER, not INT."""
    for raw, value in (("2", 2), ("2.5", 2.5)):
        code, out, err = run_cli(capsys, "config", TARGET, "--max_epochs", raw, "--format", "json")
        assert code == 0, err
        got = json.loads(out)["max_epochs"]
        assert got == value and type(got) is type(value)
    with pytest.raises(SystemExit) as e:
        main(["fit", TARGET, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--max_epochs NUMBER" in out and "--max_steps INT" in out


def test_a_stray_argument_and_several_unknown_flags(capsys):
    line = one_line_error(capsys, "fit", TARGET, "stray", "--max_steps", "1")
    assert "unexpected argument 'stray' (see lightlike fit --help)" in line
    line = one_line_error(capsys, "fit", TARGET, "--max_step", "1", "--bach_size", "2")
    assert "unknown flags --max_step (did you mean '--max_steps'?); --bach_size (did you mean '--batch_size'?)" in line


@pytest.mark.parametrize(("name", "text", "want"), [
    ("nope.toml", None, "config file 'nope.toml' does not exist"),
    ("run.ini", "max_steps = 3\n", "config file 'run.ini': unknown format; use .toml, .yaml/.yml or .json"),
    ("list.json", "[1, 2]", "config file 'list.json' must hold a table of settings, not list"),
    ("m.toml", "max_steps = 3\nmodel = 3\n", "m.toml: 'model' must be a table of constructor arguments, got 3"),
])
def test_config_file_errors(capsys, here, name, text, want):
    if text is not None:
        Path(name).write_text(text)
    assert one_line_error(capsys, "config", TARGET, "--config", name) == f"lightlike config: error: {want}"


def test_an_empty_yaml_file_is_no_settings_and_yaml_output_reads_back(capsys, here):
    pytest.importorskip("yaml")
    import yaml

    Path("empty.yaml").write_text("# nothing yet\n")
    code, out, err = run_cli(capsys, "config", TARGET, "--config", "empty.yaml", "--max_steps", "3",
                             "--model.width", "7", "--format", "yaml")
    assert code == 0, err
    assert yaml.safe_load(out)["model"]["width"] == 7 and yaml.safe_load(out)["max_steps"] == 3
    Path("back.yaml").write_text(out)
    code, again, err = run_cli(capsys, "config", TARGET, "--config", "back.yaml", "--format", "json")
    assert code == 0, err
    code, direct, _ = run_cli(capsys, "config", TARGET, "--max_steps", "3", "--model.width", "7", "--format", "json")
    assert json.loads(again) == json.loads(direct)


def test_config_comments_cover_the_constructor_arguments(capsys):
    code, out, _ = run_cli(capsys, "config", TARGET, "--max_steps", "1", "--comments")
    assert code == 0
    model = out[out.index("[model]"):]
    assert "# hidden units.\nwidth = 32\n" in model


def test_a_missing_constructor_argument_is_named(capsys, here):
    line = one_line_error(capsys, "config", "ao_net.py:Needs", "--max_steps", "1")
    assert line.endswith("Needs needs constructor argument(s) depth: pass --model.depth VALUE or set it in the "
                         "config file's [model] table")


@pytest.mark.parametrize(("word", "resumed"), [("false", False), ("no", False), ("yes", True), ("1", True)])
def test_resume_words(capsys, caplog, tmp_path, word, resumed):
    """--resume false/no start fresh (an empty output_dir), --resume yes/1 continue checkpoint-2."""
    out = tmp_path / "run"
    if resumed:
        assert main(["fit", TARGET, "--max_steps", "2", "--save_every", "2", "--output_dir", str(out), *SMALL]) == 0
    code, stdout, err = run_cli(capsys, "fit", TARGET, "--max_steps", "3", "--save_every", "3", "--output_dir", str(out),
                                "--resume", word, *SMALL)
    assert code == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["global_step"] == 3
    assert (f"resumed from {out / 'checkpoint-2'} at step 2" in caplog.text) == resumed
    assert (out / "checkpoint-2").is_dir() == resumed and (out / "checkpoint-3").is_dir()


# -- checkpoints, hparams and data ----------------------------------------------------------------
def test_an_export_folder_with_extra_hparams_and_a_file_overriding_them(capsys, tmp_path, trained):
    """validate on a `lightlike export` folder whose hparams.json holds a key the constructor does
    not take (ignored) and val_items 16, with a config file saying val_items = 8: the file wins
    (defaults < hparams.json < file < flags); the metrics equal Fitter.validate on 8 items."""
    export = tmp_path / "export"
    assert main(["export", str(trained), str(export)]) == 0
    hparams = json.loads((export / "hparams.json").read_text())
    assert hparams["val_items"] == 16
    (export / "hparams.json").write_text(json.dumps({**hparams, "note": "not an argument"}))
    (tmp_path / "v.toml").write_text("[model]\nval_items = 8\n")
    capsys.readouterr()
    code, out, err = run_cli(capsys, "validate", TARGET, "--checkpoint", str(export), "--config", str(tmp_path / "v.toml"),
                             "--batch_size", "16", "--loggers", "[]")
    assert code == 0, err
    mod, module = reference_module(trained, val_items=8)
    want = ll.Fitter(max_epochs=1, batch_size=16, loggers=[], output_dir=str(tmp_path / "ref")).validate(
        module, module.val_data())
    got = json.loads(out.strip().splitlines()[-1])
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-12) for k in got)
    other = ll.Fitter(max_epochs=1, batch_size=16, loggers=[], output_dir=str(tmp_path / "ref")).validate(
        module, mod.TeacherData(16, 16, 4, seed=1))
    assert got["val/loss"] != pytest.approx(other["val/loss"], rel=1e-9)  # 8 items, not hparams' 16


def test_a_folder_without_a_checkpoint_is_refused(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line_error(capsys, "validate", TARGET, "--checkpoint", str(tmp_path / "empty"))
    assert f"--checkpoint {str(tmp_path / 'empty')!r} is neither a checkpoint, an export folder, nor an output_dir" in line


def test_constructor_flags_reach_hparams_json_without_save_hyperparameters(capsys, here):
    """Net records no hparams itself: the CLI writes its constructor arguments, so validate on
    the checkpoint builds width 5 again (width 3, the default, would not load the weights)."""
    code, _, err = run_cli(capsys, "fit", "ao_net.py:Net", "--max_steps", "1", "--save_every", "1", "--batch_size", "4",
                           "--model.width", "5", "--output_dir", "out", "--loggers", "[]")
    assert code == 0, err
    assert json.loads((here / "out" / "checkpoint-1" / "hparams.json").read_text()) == {"width": 5}
    code, out, err = run_cli(capsys, "validate", "ao_net.py:Net", "--checkpoint", "out/checkpoint-1", "--loggers", "[]")
    assert code == 0, err


def test_test_falls_back_to_the_validation_data_and_says_so(capsys, here):
    """Net has no test_data(): `lightlike test` evaluates val_data() (8 items), with a note."""
    code, out, err = run_cli(capsys, "test", "ao_net.py:Net", "--batch_size", "8", "--loggers", "[]")
    assert code == 0, err
    assert "lightlike test: note: no test data, using the val data" in err
    code, out2, err2 = run_cli(capsys, "validate", "ao_net.py:Net", "--batch_size", "8", "--loggers", "[]")
    assert "note" not in err2
    assert json.loads(out.strip().splitlines()[-1])["test/loss_sum"] == pytest.approx(
        json.loads(out2.strip().splitlines()[-1])["val/loss_sum"], rel=1e-12)


@pytest.mark.parametrize(("spec", "want"), [
    ("ao_factories.py:five", "--data ao_factories.py:five: returned a tuple of 5; return (train, val) or (train, val, test)"),
    ("ao_factories.py:misspelt", "--data ao_factories.py:misspelt: unknown key 'vall' (did you mean 'val'?); "
                                 "use train, val, test, predict"),
])
def test_data_factory_shapes_refused(capsys, here, spec, want):
    line = one_line_error(capsys, "fit", TARGET, "--data", spec, "--max_steps", "1", "--output_dir", "out", *SMALL)
    assert line == f"lightlike fit: error: {want}"


def test_data_factories_returning_one_set_or_taking_kwargs(capsys, here, trained):
    """A factory returning one dataset gives the command's own role (validate: val); one taking
    **kwargs gets the config (8 x batch 2 items: 8 steps in an epoch)."""
    code, out, err = run_cli(capsys, "validate", TARGET, "--checkpoint", str(trained), "--data", "ao_factories.py:one",
                             "--batch_size", "4", "--loggers", "[]")
    assert code == 0, err
    import ao_factories

    _, module = reference_module(trained)
    want = ll.Fitter(max_epochs=1, batch_size=4, loggers=[], output_dir="ref").validate(module, ao_factories.one())
    got = json.loads(out.strip().splitlines()[-1])
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-12) for k in got)
    code, out, err = run_cli(capsys, "fit", TARGET, "--data", "ao_factories.py:anything", "--max_epochs", "1",
                             "--batch_size", "2", "--output_dir", "kw", *SMALL)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["global_step"] == 8


def test_predictions_file_as_json(capsys, tmp_path, trained):
    path = tmp_path / "sub" / "p.json"
    code, out, err = run_cli(capsys, "predict", TARGET, "--checkpoint", str(trained), "--batch_size", "4",
                             "--predictions_file", str(path), "--loggers", "[]")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["predictions_file"] == str(path)
    written = json.loads(path.read_text())
    _, module = reference_module(trained)
    want = ll.Fitter(max_epochs=1, batch_size=4, loggers=[], output_dir=str(tmp_path / "ref")).predict(
        module, module.test_data())
    assert written["predictions"] == want.predictions.tolist() and written["labels"] == want.labels.tolist()
    assert written["metrics"] == pytest.approx(want.metrics, rel=1e-12)
    assert torch.tensor(written["predictions"]).shape == (16,)

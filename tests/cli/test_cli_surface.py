"""The command line's surface: what it accepts and how it answers a mistake. Each test drives the
real ``lightlike`` command (``lightlike.cli.main``, in process) and expects, for a user error, one
line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lightlike as ll
from lightlike.cli import main

ROOT = Path(__file__).resolve().parents[2]
TARGET = f"{ROOT / 'examples' / 'cli_module.py'}:Classifier"
SMALL = ["--loggers", "[]", "--model_summary", "false", "--model.train_items", "32", "--model.val_items", "16"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *args: str) -> str:
    code, _, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and ": error: " in lines[0], (code, err)
    return lines[0]


# -- 1: the [model] table is typed as the --model.* flags are ------------------------------------
@pytest.mark.parametrize(("name", "text", "want"), [
    ("w.toml", 'max_steps = 2\n[model]\nwidth = "abc"\n', "w.toml: model.width: expected int, got 'abc'"),
    ("w.toml", "max_steps = 2\n[model]\nwidth = 64.0\n", "w.toml: model.width: expected int, got 64.0 (float); write 64"),
    ("w.toml", "max_steps = 2\n[model]\nwidth = true\n", "w.toml: model.width: expected int, got True (bool)"),
    ("w.toml", "max_steps = 2\n[model]\ndropout = [0.1]\n", "w.toml: model.dropout: expected float, got [0.1] (list)"),
    ("w.yaml", "max_steps: 2\nmodel:\n  width: 1e2\n", "w.yaml: model.width: expected int, got '1e2'"),
    ("w.json", '{"max_steps": 2, "model": {"width": "12x"}}', "w.json: model.width: expected int, got '12x'"),
])
def test_model_table_values_are_type_checked(capsys, tmp_path, monkeypatch, name, text, want):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    monkeypatch.chdir(tmp_path)
    Path(name).write_text(text)
    line = one_line_error(capsys, "fit", TARGET, "--config", name, "--output_dir", "out", *SMALL)
    assert line == f"lightlike fit: error: {want}"
    assert not (tmp_path / "out").exists()


def test_model_table_values_of_the_right_type_are_taken(capsys, tmp_path, monkeypatch):
    """Strings converted as flags are (YAML's 1e-3), an int where a float goes, None where the
    default is None: all accepted, as before."""
    monkeypatch.chdir(tmp_path)
    Path("ok.toml").write_text('max_steps = 2\n[model]\nwidth = 48\ndropout = 0\n')
    code, out, err = run_cli(capsys, "config", TARGET, "--config", "ok.toml")
    assert code == 0, err
    assert "width = 48" in out and "dropout = 0" in out


# -- 2: num_cycles must be finite ----------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("scheduler", ["cosine", "cosine_with_restarts"])
def test_num_cycles_must_be_finite(capsys, tmp_path, scheduler, value):
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "2", "--lr_scheduler", scheduler,
                          f"--num_cycles={value}", "--output_dir", str(tmp_path / "out"), *SMALL)
    assert line == f"lightlike fit: error: num_cycles must be finite, got {float(value)!r}"
    with pytest.raises(ll.ConfigError, match="num_cycles must be finite"):
        ll.FitConfig(max_steps=1, num_cycles=float(value))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_power_must_be_finite(capsys, tmp_path, value):
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "2", "--lr_scheduler", "polynomial",
                          f"--power={value}", "--output_dir", str(tmp_path / "out"), *SMALL)
    assert line == f"lightlike fit: error: power must be finite, got {float(value)!r}"


# -- 3: --flag VALUE takes every negative number --flag=VALUE does ------------------------------
@pytest.mark.parametrize("value", ["-1e-3", "-1.5e-3", "-1E+2", "-inf", "-0.5", "-2"])
def test_negative_numbers_as_separate_values(capsys, value):
    joined = run_cli(capsys, "config", TARGET, "--max_steps", "1", f"--model.dropout={value}", "--format", "json")
    spaced = run_cli(capsys, "config", TARGET, "--max_steps", "1", "--model.dropout", value, "--format", "json")
    assert joined[0] == 0 and spaced[0] == 0, spaced[2]
    assert spaced[1] == joined[1]
    assert f'"dropout": {float(value)!r}'.replace("inf", "Infinity") in spaced[1]


def test_negative_number_for_a_setting_is_checked_as_a_value(capsys):
    line = one_line_error(capsys, "config", TARGET, "--max_steps", "1", "--learning_rate", "-1e-3")
    assert "learning_rate must be >= 0, got -0.001" in line


# -- 4: "did you mean" names a related flag -------------------------------------------------------
@pytest.mark.parametrize(("flag", "want"), [
    ("--devices", "(did you mean '--accelerator'? lightlike runs one process per device, started by torchrun "
                  "--nproc_per_node N or srun: there is no device count to set)"),
    ("--disable_tqdm", "(did you mean '--progress_bar'?"),
    ("--enable_progress_bar", "(did you mean '--progress_bar'?)"),
    ("--val_check_interval", "(did you mean --eval_every or --eval_on_epoch_end?)"),
    ("--check_val_every_n_epoch", "(did you mean '--eval_on_epoch_end'?)"),
    ("--eval_strategy", "(did you mean --eval_every or --eval_on_epoch_end?)"),
    ("--default_root_dir", "(did you mean '--output_dir'?)"),
    ("--max_step", "(did you mean '--max_steps'?)"),
    ("--fp16", "(did you mean --precision 16-mixed?)"),
    ("--resume_from_checkpoint", "(did you mean '--resume'?)"),
    ("--num_nodes", "(not a lightlike setting: the launcher sets the nodes: torchrun --nnodes N, or sbatch --nodes N"),
    ("--gpus", "(not a lightlike setting: lightlike runs one process per device, started by torchrun"),
    ("--max_time", "(not a lightlike setting: bound a run by max_steps or max_epochs;"),
])
def test_unknown_flag_hints(capsys, tmp_path, flag, want):
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "1", flag, "1", "--output_dir", str(tmp_path / "o"))
    assert f"unknown flag {flag} {want}" in line


@pytest.mark.parametrize("flag", ["--fast_dev_run", "--xyzzy"])
def test_unrelated_flags_get_no_hint(capsys, tmp_path, flag):
    """Compared without the '--' every flag shares, a name like nothing valid gets no suggestion
    (--gpus got '--fused', --fast_dev_run '--save_every'; --gpus is now answered with the launcher)."""
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "1", flag, "1", "--output_dir", str(tmp_path))
    assert line == f"lightlike fit: error: unknown flag {flag} (see lightlike fit --help)"


@pytest.mark.parametrize(("key", "want"), [
    ("devices", "(did you mean 'accelerator'? lightlike runs one process per device"),
    ("disable_tqdm", "(did you mean 'progress_bar'?"),
    ("val_check_interval", "(did you mean eval_every or eval_on_epoch_end?)"),
    ("default_root_dir", "(did you mean 'output_dir'?)"),
    ("fsdp", "(did you mean strategy='fsdp'?"),  # HF's names of the sharded strategies (docs/migrating.md)
    ("deepspeed", "(did you mean strategy='deepspeed_zero3'?"),
    ("gradient_clip_algorithm", "(did you mean max_grad_norm or max_grad_value?)"),  # Lightning's
])
def test_python_api_gives_the_same_hints(key, want):
    with pytest.raises(ll.ConfigError) as e:
        ll.Fitter(max_steps=1, **{key: 1})
    assert f"unknown config key(s): {key!r} {want}" in str(e.value)


def test_config_file_key_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("h.toml").write_text("max_steps = 1\ndevices = 2\n")
    line = one_line_error(capsys, "config", TARGET, "--config", "h.toml")
    assert "h.toml: unknown key 'devices' (did you mean 'accelerator'?" in line


@pytest.mark.parametrize(("text", "want"), [
    # a run setting under [model] was answered with a look-alike constructor argument
    ("[model]\nmax_steps = 5\n", "unknown key 'model.max_steps' ('max_steps' is a run setting: put it at the top "
                                  "level of the file, outside the 'model' table)"),
    ("[model]\nlearning_rate = 0.1\n", "'learning_rate' is a run setting"),
    # a constructor argument at the top level was answered with nothing
    ("width = 64\n", "unknown key 'width' (a constructor argument of the module: put it in the 'model' table, "
                     "[model] in TOML)"),
])
def test_config_file_key_in_the_wrong_section(capsys, tmp_path, monkeypatch, text, want):
    monkeypatch.chdir(tmp_path)
    Path("w.toml").write_text(text)
    line = one_line_error(capsys, "fit", TARGET, "--config", "w.toml", "--max_steps", "1", *SMALL)
    assert f"w.toml: {want}" in line if want.startswith("unknown") else want in line


# -- 5: the output_dir hint offers the flag that works -------------------------------------------
def test_output_dir_hint_matches_the_message(capsys, tmp_path):
    out = tmp_path / "od"
    (out / "logs").mkdir(parents=True)  # logs only: nothing to resume
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "2", "--output_dir", str(out), *SMALL)
    assert "pass resume='auto'" in line
    assert line.endswith("(on the command line: --resume auto, or --overwrite_output_dir, or another --output_dir)")
    # --resume there (a first run killed before its first save): the hint led in a circle
    # ("start without resume", which is refused above), in Python terms only
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "2", "--output_dir", str(out), "--resume", *SMALL)
    assert "holds no valid checkpoint" in line and "start without resume" not in line
    assert line.endswith("(on the command line: --resume auto, or another --output_dir)")
    code, _, err = run_cli(capsys, "fit", TARGET, "--max_steps", "2", "--output_dir", str(out), "--resume", "auto",
                           *SMALL)
    assert code == 0, err  # what the hint says works

    ckpt = tmp_path / "ckpt"  # a resumable checkpoint: plain --resume
    assert run_cli(capsys, "fit", TARGET, "--max_steps", "2", "--save_every", "2", "--output_dir", str(ckpt),
                   *SMALL)[0] == 0
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "4", "--output_dir", str(ckpt), *SMALL)
    assert "pass resume=True" in line
    assert line.endswith("(on the command line: --resume, or --overwrite_output_dir, or another --output_dir)")


# -- 6: seed range ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**63, 2**32, -1, -(2**63)])
def test_seed_out_of_range(capsys, tmp_path, seed):
    """Seeds outside [0, 2**32 - 1] repeat the random streams of one inside it (torch and numpy
    keep 32 bits of a seed): refused, naming the seed it would repeat."""
    line = one_line_error(capsys, "fit", TARGET, "--max_steps", "1", f"--seed={seed}", "--output_dir",
                          str(tmp_path / "o"), *SMALL)
    assert "seed must be in [0, 2**32 - 1]: torch's and numpy's generators keep only the low 32 bits" in line
    assert f"(seed={seed} draws torch's and numpy's streams of seed={seed % 2**32})" in line
    assert line.endswith(f"got {seed}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("seed", [2**32 - 1, 0])
def test_seed_at_the_limits_trains_two_epochs(capsys, tmp_path, seed):
    """The seed is taken as given at either limit: two whole epochs of 32 items, and the weights,
    loss and steps of the same fit through the Python API with that seed, whose module starts from
    ``torch.manual_seed(seed)``'s weights."""
    import math

    import torch
    from safetensors.torch import load_file

    from examples.cli_module import Classifier

    code, out, err = run_cli(capsys, "fit", TARGET, "--max_epochs", "2", f"--seed={seed}", "--save_every", "4",
                             "--output_dir", str(tmp_path / "o"), *SMALL)
    assert code == 0, err
    printed = json.loads(out.strip().splitlines()[-1])
    fitter = ll.Fitter(max_epochs=2, seed=seed, loggers=[], model_summary=False, output_dir=str(tmp_path / "api"))
    with fitter.init_module():
        module = Classifier(train_items=32, val_items=16)
    initial = module.net[0].weight.detach().clone()
    result = fitter.fit(module, module.train_data(), module.val_data())
    assert printed["global_step"] == result.global_step == 2 * math.ceil(32 / ll.FitConfig().batch_size)
    assert result.state.epoch == 2.0
    assert printed["training_loss"] == result.training_loss
    assert printed["last_checkpoint"] == str(tmp_path / "o" / "checkpoint-8")
    saved = load_file(str(Path(printed["last_checkpoint"]) / "model.safetensors"))
    want = module.state_dict()
    assert sorted(saved) == sorted(want) and all(torch.equal(saved[k], want[k]) for k in want)
    torch.manual_seed(seed)  # the module was built from torch's stream for that seed, as given
    assert torch.equal(Classifier(train_items=32, val_items=16).net[0].weight, initial)


# -- 7: export names a missing path and a run's output_dir ---------------------------------------
def test_export_missing_path(capsys, tmp_path):
    line = one_line_error(capsys, "export", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert line == f"lightlike export: error: export: no such checkpoint directory: {str(tmp_path / 'nope')!r}"
    assert not (tmp_path / "out").exists()


def test_export_an_output_dir_exports_its_newest_valid_checkpoint(capsys, tmp_path):
    """`lightlike export RUN OUT`: the newest valid checkpoint's weights, and a line naming it (and
    a newer torn one as skipped); a run without a valid checkpoint leaves no OUT behind."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert run_cli(capsys, "fit", TARGET, "--max_steps", "4", "--save_every", "2", "--output_dir", str(run),
                   *SMALL)[0] == 0
    code, out, err = run_cli(capsys, "export", str(run), str(tmp_path / "out4"))
    assert code == 0 and f"lightlike: --checkpoint {run}" not in err
    assert f"lightlike: export {run}: using checkpoint-4, the newest valid checkpoint" in err
    (run / "checkpoint-4" / "manifest.json").unlink()  # torn: the newest valid one is older
    code, out, err = run_cli(capsys, "export", str(run), str(tmp_path / "out"))
    assert code == 0 and "using checkpoint-2, the newest valid checkpoint; skipped the newer checkpoint-4 (" in err
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    saved = load_file(str(run / "checkpoint-2" / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    newest = load_file(str(tmp_path / "out4" / "model.safetensors"))
    assert not all(torch.equal(newest[k], saved[k]) for k in saved)  # (checkpoint-4's, taken before it tore)


def test_export_an_output_dir_without_a_valid_checkpoint(capsys, tmp_path):
    (tmp_path / "run" / "checkpoint-3").mkdir(parents=True)
    line = one_line_error(capsys, "export", str(tmp_path / "run"), str(tmp_path / "out"))
    assert "is a run's output_dir, not one checkpoint, and holds no valid checkpoint" in line
    assert not (tmp_path / "out").exists()


# -- 8: a Literal constructor argument takes only its values ------------------------------------
LITERAL_MODULE = '''
from __future__ import annotations
from typing import Literal, Optional
import torch
from torch import nn
import lightlike as ll

class Net(ll.TaskModule):
    def __init__(self, act: Literal["relu", "gelu"] = "relu", depth: Literal[1, 2] = 1,
                 norm: Optional[Literal["layer", "batch"]] = None):
        super().__init__()
        self.act, self.depth, self.norm = act, depth, norm
        self.net = nn.Linear(4, 2)

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return outputs.pow(2).mean()
'''


@pytest.mark.parametrize(("args", "toml", "want"), [
    (["--model.act", "swish"], None, "model.act: expected one of 'relu', 'gelu', got 'swish'"),
    (["--model.act", "gelo"], None, "got 'gelo' (did you mean 'gelu'?)"),
    (["--model.depth", "3"], None, "model.depth: expected one of 1, 2, got 3"),
    (["--model.norm", "group"], None, "expected one of 'layer', 'batch', got 'group'"),
    ([], '[model]\nact = "swish"\n', "m.toml: model.act: expected one of 'relu', 'gelu', got 'swish'"),
    ([], "[model]\ndepth = 5\n", "m.toml: model.depth: expected one of 1, 2, got 5"),
])
def test_literal_arguments_take_only_their_values(capsys, tmp_path, monkeypatch, args, toml, want):
    monkeypatch.chdir(tmp_path)
    Path("literal_net.py").write_text(LITERAL_MODULE)
    extra = []
    if toml is not None:
        Path("m.toml").write_text(toml)
        extra = ["--config", "m.toml"]
    line = one_line_error(capsys, "config", "literal_net.py:Net", "--max_steps", "1", *extra, *args)
    assert want in line


def test_a_literal_argument_defaulting_to_none_takes_null(capsys, tmp_path, monkeypatch):
    """``x: Literal["a", "b"] = None`` (an implicit Optional): a config file's null was refused."""
    monkeypatch.chdir(tmp_path)
    Path("literal_net.py").write_text(LITERAL_MODULE.replace('norm: Optional[Literal["layer", "batch"]] = None',
                                                             'norm: Literal["layer", "batch"] = None'))
    Path("n.json").write_text('{"max_steps": 1, "model": {"norm": null}}')
    code, out, err = run_cli(capsys, "config", "literal_net.py:Net", "--config", "n.json", "--format", "json")
    assert code == 0, err
    assert '"norm": null' in out


def test_literal_arguments_accept_their_values(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("literal_net.py").write_text(LITERAL_MODULE)
    code, out, err = run_cli(capsys, "config", "literal_net.py:Net", "--max_steps", "1", "--model.act", "gelu",
                             "--model.depth", "2", "--model.norm", "none", "--format", "json")
    assert code == 0, err
    assert '"act": "gelu"' in out and '"depth": 2' in out and '"norm": null' in out


MIXED_MODULE = LITERAL_MODULE.replace(
    'norm: Optional[Literal["layer", "batch"]] = None',
    'pad: bool | str = False, bucket: bool | int = False, mode: Literal[True, False, "longest"] = False')


@pytest.mark.parametrize(("args", "want"), [
    (["--model.pad", "longest"], ['"pad": "longest"']),  # the space form was read as --model.pad=true
    (["--model.pad=longest"], ['"pad": "longest"']),
    (["--model.pad", "--max_steps", "2"], ['"pad": true', '"max_steps": 2']),  # bare: true
    (["--model.pad"], ['"pad": true']),
    (["--model.pad", "no"], ['"pad": false']),
    (["--model.bucket", "8"], ['"bucket": 8']),
    (["--model.bucket", "--model.pad", "x"], ['"bucket": true', '"pad": "x"']),
    (["--model.mode", "longest"], ['"mode": "longest"']),
    (["--model.mode", "--model.pad", "x"], ['"mode": true']),
])
def test_a_bool_or_value_argument_takes_the_next_word(capsys, tmp_path, monkeypatch, args, want):
    """``pad: bool | str``: ``--model.pad longest`` is ``pad="longest"``, as ``--model.pad=longest``;
    given alone (before another flag or at the end) it is true."""
    monkeypatch.chdir(tmp_path)
    Path("mixed_net.py").write_text(MIXED_MODULE)
    code, out, err = run_cli(capsys, "config", "mixed_net.py:Net", "--max_steps", "1", "--format", "json", *args)
    assert code == 0, err
    for w in want:
        assert w in out, out


# -- 9: a bad value from the config file names the file ------------------------------------------
@pytest.mark.parametrize(("text", "flags", "want"), [
    ("max_steps = -3\n", [], "c.toml: max_steps must be a positive int, got -3"),
    ('max_steps = "abc"\n', [], "c.toml: max_steps='abc' (str) is not valid"),
    ('max_steps = 2\nlr_scheduler = "cosin"\n', [], "c.toml: lr_scheduler='cosin' is not valid (did you mean 'cosine'?)"),
    ("max_steps = 2\nwarmup_ratio = 1.5\n", [], "c.toml: warmup_ratio must be in [0, 1), got 1.5"),
    ('max_steps = 3\nload_best_at_end = true\nmetric_for_best = "val/loss"\nsave_strategy = "no"\n', [],
     "c.toml: load_best_at_end=True but save_strategy='no' saves no checkpoint to load"),
    # the flag's value is the bad one: no file named
    ("max_steps = 3\n", ["--max_steps", "-2"], "error: max_steps must be a positive int, got -2"),
    ("max_steps = -3\n", ["--max_steps", "-2"], "error: max_steps must be a positive int, got -2"),
])
def test_a_bad_value_from_the_config_file_names_the_file(capsys, tmp_path, monkeypatch, text, flags, want):
    monkeypatch.chdir(tmp_path)
    Path("c.toml").write_text(text)
    line = one_line_error(capsys, "config", TARGET, "--config", "c.toml", *flags)
    assert want in line
    if not flags:
        assert line.startswith(f"lightlike config: error: {want}")


# -- 10: comma lists, targets without :Class, **kwargs ------------------------------------------
LIST_MODULE = '''
from torch import nn
import lightlike as ll

class Base(ll.TaskModule):
    def __init__(self, width: int = 4, **kwargs):
        super().__init__()
        self.net = nn.Linear(4, width)

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return outputs.pow(2).mean()
'''


def test_comma_separated_lists(capsys, tmp_path, monkeypatch):
    """A list-typed setting or constructor argument takes ``a,b``; each item is read as JSON
    (numbers stay numbers) or else kept as a string."""
    monkeypatch.chdir(tmp_path)
    Path("list_net.py").write_text(LIST_MODULE + '''

class Net(Base):
    def __init__(self, sizes: list[int] = (4,), names: list[str] | None = None, mix: list = ()):
        super().__init__()
''')
    code, out, err = run_cli(capsys, "config", "list_net.py:Net", "--max_steps", "1", "--format", "json",
                             "--preemption_signals", "SIGTERM,SIGUSR1", "--model.sizes", "1, 2,3",
                             "--model.names", "a,b", "--model.mix", "1,x,0.5,true")
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["preemption_signals"] == ["SIGTERM", "SIGUSR1"]
    assert resolved["model"] == {"sizes": [1, 2, 3], "names": ["a", "b"], "mix": [1, "x", 0.5, True]}


def test_a_target_file_without_a_class_name_takes_the_class_defined_there(capsys, tmp_path, monkeypatch):
    """The file imports one TaskModule subclass and defines another: the defined one is the target."""
    monkeypatch.chdir(tmp_path)
    Path("imported_base_x.py").write_text(LIST_MODULE)
    Path("defines_net_x.py").write_text("from imported_base_x import Base\n\n\nclass Net(Base):\n"
                                        "    def __init__(self, depth: int = 2, width: int = 4):\n"
                                        "        super().__init__(width=width)\n")
    code, out, err = run_cli(capsys, "config", "defines_net_x.py", "--max_steps", "1", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["model"] == {"depth": 2, "width": 4}  # Net's arguments, not Base's


def test_a_module_taking_kwargs_accepts_any_key_in_the_model_table(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kw_net.py").write_text(LIST_MODULE)
    Path("k.toml").write_text('max_steps = 1\n[model]\nwidth = 3\nextra = 5\nname = "x"\n')
    code, out, err = run_cli(capsys, "config", "kw_net.py:Base", "--config", "k.toml", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["model"] == {"width": 3, "extra": 5, "name": "x"}
    # without **kwargs the same table is refused, naming the key
    Path("nokw_net.py").write_text(LIST_MODULE.replace(", **kwargs", ""))
    line = one_line_error(capsys, "config", "nokw_net.py:Base", "--config", "k.toml")
    assert "k.toml: unknown key 'model.extra'" in line

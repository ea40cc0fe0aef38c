"""The ``lightlike`` command line, driven for real in subprocesses (``python -m lightlike.cli`` and
the installed ``lightlike`` entry point), against the Python API as the reference."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lightlike as ll

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cli_module.py"
TARGET = f"{EXAMPLE}:Classifier"
ENTRY = Path(sys.executable).parent / "lightlike"
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "GROUP_RANK"))}

#: The main run: the file says max_steps = 12 and width = 24, the flags say 16 and 20 (flags win);
#: in_features and dropout come from the file only.
TOML = """\
max_steps = 12
batch_size = 16
learning_rate = 0.01
eval_every = 8
save_every = 8
loggers = ["csv"]
seed = 3

[model]
width = 24
in_features = 12
train_items = 256
val_items = 96
"""
FLAGS = ["--max_steps", "16", "--model.width", "20", "--lr-scheduler", "cosine", "--model_summary", "false"]


def cli(*args: str, entry: bool = False, ok: bool = True, cwd: Path | None = None, timeout: float = 120):
    """Run the command line as a user does; with ``ok``, expect success and return stdout's last
    line as JSON (the commands print their result there) along with the process."""
    cmd = [str(ENTRY)] if entry else [sys.executable, "-m", "lightlike.cli"]
    if entry and not ENTRY.exists():
        pytest.skip(f"no installed entry point at {ENTRY} (pip install -e .)")
    p = subprocess.run([*cmd, *args], capture_output=True, text=True, env=CLEAN, cwd=cwd, timeout=timeout)
    if not ok:
        return p
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-3000:]}"
    text = p.stdout.strip()
    last = text.splitlines()[-1] if text else ""
    if text.startswith("{") and text.endswith("}") and "\n" in text and not last.startswith("{"):
        return json.loads(text), p  # `config --format json`: one indented document
    return (json.loads(last) if last.startswith("{") else None), p


def load_example():
    spec = importlib.util.spec_from_file_location("cli_module_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fit through ``python -m lightlike.cli`` with a TOML config and overriding flags."""
    d = tmp_path_factory.mktemp("cli")
    (d / "run.toml").write_text(TOML)
    out = d / "out"
    result, proc = cli("fit", TARGET, "--config", str(d / "run.toml"), "--output_dir", str(out), *FLAGS, cwd=d)
    return {"dir": d, "out": out, "result": result, "stderr": proc.stderr}


def test_fit_toml_config_and_flags(run):
    """Flags win over the file: 16 steps (not 12), checkpoints at 8 and 16, a final eval metric."""
    out, result = run["out"], run["result"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-16", "checkpoint-8"]
    assert result["global_step"] == 16 and result["last_checkpoint"] == str(out / "checkpoint-16")
    assert 0.0 <= result["metrics"]["val/accuracy"] <= 1.0 and result["metrics"]["val/loss"] > 0
    saved = json.loads((out / "checkpoint-16" / "config.json").read_text())
    assert (saved["max_steps"], saved["batch_size"], saved["lr_scheduler"], saved["seed"]) == (16, 16, "cosine", 3)
    assert (out / "logs" / "metrics.csv").is_file() or any((out / "logs").iterdir())
    assert "Traceback" not in run["stderr"]


def test_config_command_prints_what_the_run_used(run):
    """``lightlike config`` (installed entry point) with the same file and flags prints exactly
    the FitConfig in the checkpoint's config.json and the constructor arguments in hparams.json;
    its TOML output, fed back as --config, resolves to the same again."""
    d, ckpt = run["dir"], run["out"] / "checkpoint-16"
    common = ["--config", str(d / "run.toml"), "--output_dir", str(run["out"]), *FLAGS]
    printed, _ = cli("config", TARGET, *common, "--format", "json", entry=True, cwd=d)
    model = printed.pop("model")
    assert printed == json.loads((ckpt / "config.json").read_text())
    assert model == json.loads((ckpt / "hparams.json").read_text())
    _, proc = cli("config", TARGET, *common, "--comments", entry=True, cwd=d)
    assert "# Peak learning rate." in proc.stdout and "[model]" in proc.stdout
    (d / "resolved.toml").write_text(proc.stdout)
    again, _ = cli("config", TARGET, "--config", str(d / "resolved.toml"), "--format", "json", entry=True, cwd=d)
    assert again == {**printed, "model": model}


def test_constructor_args_reach_the_module(run):
    """--model.width (flag) and [model] in_features (file) built the module: hparams.json says so,
    and so do the saved weights' shapes."""
    ckpt = run["out"] / "checkpoint-16"
    hparams = json.loads((ckpt / "hparams.json").read_text())
    assert (hparams["width"], hparams["in_features"], hparams["classes"], hparams["train_items"]) == (20, 12, 4, 256)
    weights = load_file(str(ckpt / "model.safetensors"))
    assert tuple(weights["net.0.weight"].shape) == (20, 12) and tuple(weights["net.3.weight"].shape) == (4, 20)


def test_cli_fit_equals_python_api(run, tmp_path):
    """The same settings through ``ll.Fitter`` give the same weights and final metrics."""
    ex = load_example()
    fitter = ll.Fitter(max_steps=16, batch_size=16, learning_rate=0.01, eval_every=8, save_every=8, seed=3,
                       lr_scheduler="cosine", loggers=[], model_summary=False, output_dir=str(tmp_path))
    module = ex.Classifier(width=20, in_features=12, train_items=256, val_items=96)
    result = fitter.fit(module, module.train_data(), module.val_data())
    cli_weights = load_file(str(run["out"] / "checkpoint-16" / "model.safetensors"))
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(cli_weights[name], tensor, rtol=0, atol=1e-6)
    assert result.metrics["val/loss"] == pytest.approx(run["result"]["metrics"]["val/loss"], rel=1e-6)


def test_validate_test_predict_match_python_api(run, tmp_path):
    """On a checkpoint (constructor arguments from its hparams.json): the metrics the CLI prints
    equal ``Fitter.validate/test/predict`` on the same weights; predict writes its predictions."""
    ckpt = run["out"] / "checkpoint-16"
    ex = load_example()
    module = ex.Classifier(**json.loads((ckpt / "hparams.json").read_text()))
    module.load_weights(ckpt)
    fitter = ll.Fitter(max_epochs=1, batch_size=16, loggers=[], output_dir=str(tmp_path / "ref"))
    want_val = fitter.validate(module, module.val_data())
    want_test = fitter.test(module, module.test_data())
    want_pred = fitter.predict(module, module.test_data())

    val, _ = cli("validate", TARGET, "--checkpoint", str(ckpt), "--batch_size", "16", entry=True)
    assert val.keys() == want_val.keys() and all(val[k] == pytest.approx(want_val[k], rel=1e-12) for k in val)
    test, _ = cli("test", TARGET, "--checkpoint", str(run["out"]), "--batch_size", "16")  # newest in output_dir
    assert test.keys() == want_test.keys() and all(test[k] == pytest.approx(want_test[k], rel=1e-12) for k in test)
    pred, first = cli("predict", TARGET, "--checkpoint", str(ckpt), "--batch_size", "16",
                      "--output_dir", str(tmp_path / "pred"))
    assert pred["predictions_file"] == str(tmp_path / "pred" / "predictions.pt")
    written = torch.load(pred["predictions_file"], weights_only=True)
    assert torch.equal(written["predictions"], want_pred.predictions)
    assert torch.equal(written["labels"], want_pred.labels)
    assert pred["metrics"] == pytest.approx(want_pred.metrics, rel=1e-12)
    assert "replacing" not in first.stderr
    again, p = cli("predict", TARGET, "--checkpoint", str(ckpt), "--batch_size", "16",
                   "--output_dir", str(tmp_path / "pred"))
    assert f"lightlike predict: replacing {pred['predictions_file']}" in p.stderr  # not silently


def test_yaml_config(tmp_path):
    """A YAML file (including YAML 1.1's string-typed ``1e-2``) configures a fit like TOML."""
    pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text(textwrap.dedent("""\
        max_steps: 3
        save_every: 3
        learning_rate: 1e-2
        batch_size: 32
        loggers: []
        model:
          width: 7
          train_items: 96
        """))
    result, _ = cli("fit", TARGET, "--config", "run.yaml", "--output_dir", "out", cwd=tmp_path, entry=True)
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert result["global_step"] == 3 and ckpt.is_dir()
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (cfg["learning_rate"], cfg["batch_size"], cfg["loggers"]) == (0.01, 32, [])
    assert json.loads((ckpt / "hparams.json").read_text())["width"] == 7


@pytest.mark.parametrize("case", ["flag", "model-flag", "file-key", "file-model-key", "hf-flag", "hf-key"])
def test_misspelt_names_are_named_with_the_nearest(tmp_path, case):
    """A misspelt flag or config-file key: exit 2, one line on stderr naming it and the nearest
    valid name, no traceback, nothing trained."""
    (tmp_path / "bad.toml").write_text({"file-key": "max_step = 3\n",
                                        "file-model-key": "max_steps = 3\n[model]\nwidht = 3\n",
                                        "hf-key": "max_steps = 3\nper_device_train_batch_size = 3\n"}.get(case, ""))
    args = {"flag": ["--max_step", "3"], "model-flag": ["--max_steps", "3", "--model.widht", "3"],
            "file-key": ["--config", "bad.toml"], "file-model-key": ["--config", "bad.toml"],
            "hf-flag": ["--max_steps", "3", "--lr", "0.1"], "hf-key": ["--config", "bad.toml"]}[case]
    want = {"flag": "unknown flag --max_step (did you mean '--max_steps'?)",
            "model-flag": "unknown flag --model.widht (did you mean '--model.width'?)",
            "file-key": "bad.toml: unknown key 'max_step' (did you mean 'max_steps'?)",
            "file-model-key": "bad.toml: unknown key 'model.widht' (did you mean 'model.width'?)",
            # HF Trainer names point at the field they map to, not at a look-alike (--lr_end)
            "hf-flag": "unknown flag --lr (did you mean '--learning_rate'?)",
            "hf-key": "bad.toml: unknown key 'per_device_train_batch_size' (did you mean 'batch_size'?)"}[case]
    p = cli("fit", TARGET, *args, "--output_dir", "out", ok=False, entry=case.startswith("file"), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightlike fit: error:") and want in lines[0], p.stderr
    assert not (tmp_path / "out").exists()


def test_data_factory(tmp_path):
    """--data FILE.py:FUNCTION replaces the module's own data; the function gets the config."""
    (tmp_path / "factory.py").write_text(textwrap.dedent("""\
        import torch

        def make(config):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(40 + config.batch_size, 16, generator=g)
            items = [{"x": x[i], "y": torch.tensor(i % 4)} for i in range(len(x))]
            return items, {"heldout": items[:10]}
        """))
    result, _ = cli("fit", TARGET, "--data", "factory.py:make", "--max_epochs", "1", "--batch_size", "8",
                    "--loggers", "[]", "--output_dir", "out", cwd=tmp_path)
    assert result["global_step"] == 6  # 48 items / batch 8: the factory's data, not train_data()'s 1024
    assert set(result["metrics"]) == {"heldout/loss", "heldout/accuracy", "train/loss"}
    p = cli("fit", TARGET, "--data", "factory.py:maek", "--max_steps", "1", ok=False, cwd=tmp_path)
    assert p.returncode == 2 and "has no 'maek' (did you mean 'make'?)" in p.stderr


def test_torchrun_two_processes(tmp_path):
    """Unchanged under torchrun (gloo, CPU): 2 processes x batch 8 train the weights that one
    process with batch 16 does; only rank 0 prints the result."""
    args = ["fit", TARGET, "--strategy", "ddp", "--max_steps", "4", "--save_every", "4", "--batch_size", "8",
            "--learning_rate", "0.01", "--loggers", "[]", "--model.train_items", "128", "--output_dir", "out"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "lightlike.cli", *args], capture_output=True, text=True, env=CLEAN, cwd=tmp_path,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1 and results[0]["global_step"] == 4
    ckpt = tmp_path / "out" / "checkpoint-4"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    ex = load_example()
    ref = ll.Fitter(max_steps=4, batch_size=16, learning_rate=0.01, loggers=[], model_summary=False,
                    output_dir=str(tmp_path / "ref"))
    module = ex.Classifier(train_items=128)
    ref.fit(module, module.train_data())
    got = load_file(str(ckpt / "model.safetensors"))
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)


def test_srun_two_tasks_with_an_fsdp_preset_file(tmp_path):
    """Unchanged under srun: two tasks started the way srun starts them (SLURM_* set, no torchrun),
    the strategy named by a preset file (``--strategy strategies/fsdp.toml``). The FSDP checkpoint,
    exported by ``lightlike export``, holds the weights that one process with batch 16 trains."""
    args = ["fit", TARGET, "--strategy", str(ROOT / "strategies" / "fsdp.toml"), "--max_steps", "4",
            "--save_every", "4", "--batch_size", "8", "--learning_rate", "0.01", "--loggers", "[]",
            "--model.train_items", "128", "--output_dir", "out"]
    procs = []
    for rank in range(2):
        env = {**CLEAN, "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(50000 + os.getpid() % 9999)}
        procs.append(subprocess.Popen([sys.executable, "-m", "lightlike.cli", *args], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 1 and results[0]["global_step"] == 4  # rank 0 prints
    ckpt = tmp_path / "out" / "checkpoint-4"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    cli("export", str(ckpt), str(tmp_path / "exported"))
    ex = load_example()
    ref = ll.Fitter(max_steps=4, batch_size=16, learning_rate=0.01, loggers=[], model_summary=False,
                    output_dir=str(tmp_path / "ref"))
    module = ex.Classifier(train_items=128)
    ref.fit(module, module.train_data())
    got = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert set(got) == set(module.state_dict())
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5)


def test_strategy_file_errors(tmp_path):
    """A strategy file that does not exist, or a .toml that is not an FSDP preset: one line naming it."""
    (tmp_path / "ddp.toml").write_text('strategy = "ddp"\n')
    for spec, want in (("nope.toml", "strategy='nope.toml': no such file"),
                       ("ddp.toml", "ddp.toml: strategy = 'ddp', but a .toml strategy file describes FSDP")):
        p = cli("fit", TARGET, "--strategy", spec, "--max_steps", "1", "--output_dir", "out", ok=False, cwd=tmp_path)
        assert p.returncode == 2 and want in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_help_shows_the_field_docs():
    """``lightlike --help`` lists every FitConfig field with its help; a command's help with a
    module also lists the constructor's arguments with their docstring text."""
    _, top = cli("--help", entry=True)
    for name, text in ll.FitConfig.help().items():
        assert name in top.stdout and text.split()[0] in top.stdout
    _, fit = cli("fit", TARGET, "--help")
    assert "--grad_accum_steps INT" in fit.stdout and "Micro-batches per optimizer step." in fit.stdout
    assert "--model.width INT" in fit.stdout and "hidden units." in fit.stdout


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    """``--resume auto`` (what the sbatch and torchrun recipes pass): the first launch finds no
    checkpoint and starts fresh, a relaunch continues from the newest one."""
    args = ["fit", TARGET, "--loggers", "[]", "--batch_size", "8", "--save_every", "2",
            "--model.train_items", "64", "--output_dir", str(tmp_path / "out"), "--resume", "auto"]
    first, _ = cli(*args, "--max_steps", "2")
    assert first["global_step"] == 2
    second, proc = cli(*args, "--max_steps", "4")
    assert second["global_step"] == 4 and "checkpoint-2" in proc.stderr


def test_resume_paths_and_unparsable_yaml_are_one_line_errors(tmp_path):
    """A missing checkpoint path was reported as a stray argument, the output_dir itself as a torn
    checkpoint ('manifest.json is missing'), and a YAML parse error took four lines."""
    cli("fit", TARGET, "--max_steps", "2", "--save_every", "2", "--output_dir", "rr", "--loggers", "[]", cwd=tmp_path)
    (tmp_path / "bad.yaml").write_text("max_steps: 3\n  bad: [x\n")
    cases = [(["fit", TARGET, "--max_steps", "4", "--output_dir", "rr", "--resume", "rr/checkpoint-99"],
              "resume='rr/checkpoint-99': no such checkpoint directory"),
             (["fit", TARGET, "--max_steps", "4", "--output_dir", "rr", "--resume", "rr"],
              "resume='rr' is a run's output_dir, not one checkpoint"),
             (["config", TARGET, "--config", "bad.yaml"], "does not parse: mapping values are not allowed here")]
    for args, want in cases:
        p = cli(*args, ok=False, cwd=tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and want in lines[0], p.stderr


def test_fit_without_a_stopping_criterion_is_refused_before_anything_is_built(tmp_path):
    """FitConfig no longer needs max_steps/max_epochs (validate and predict do not): `fit`
    still says so at once, before the module (here one that cannot be built) or the data."""
    (tmp_path / "unbuildable.py").write_text(textwrap.dedent("""\
        import lightlike as ll

        class Model(ll.TaskModule):
            def __init__(self):
                raise RuntimeError("the module was built")
        """))
    p = cli("fit", "unbuildable.py:Model", "--output_dir", "out", ok=False, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == "lightlike fit: error: no stopping criterion: set max_steps=N or max_epochs=N", p.stderr
    assert not (tmp_path / "out").exists()

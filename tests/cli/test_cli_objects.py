"""Callbacks and loggers named in a config file or a flag, as LightningCLI's ``class_path`` /
``init_args`` (``lightlike/cli_objects.py``): one real fit through ``python -m lightlike.cli``,
read back through what the objects wrote; the resolved config written and read back in TOML,
YAML and JSON; each bad entry answered by one line naming the key and the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightlike.cli import main

ROOT = Path(__file__).resolve().parents[2]
TARGET = f"{ROOT / 'examples' / 'cli_module.py'}:Classifier"
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "GROUP_RANK"))}
CLEAN["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

#: The user's own classes, in a module of the run's directory (imported as ``python -m`` would).
OBJECTS = textwrap.dedent('''
    import json
    from pathlib import Path

    import lightlike as ll
    from lightlike.loggers import Logger


    class Recorder(ll.Callback):
        """Writes its arguments, the evaluations it saw and every callback of the fit to ``path``."""

        def __init__(self, path: str, tag: str = "none"):
            self.path, self.tag, self.evaluations = Path(path), tag, []

        def on_evaluate(self, fitter, state, control, metrics):
            self.evaluations.append(state.global_step)

        def on_fit_end(self, fitter, state, control):
            callbacks = [[type(cb).__name__, {k: getattr(cb, k) for k in ("monitor", "patience", "mode")
                                              if hasattr(cb, k)}] for cb in fitter.callbacks.callbacks]
            self.path.write_text(json.dumps({"tag": self.tag, "evaluations": self.evaluations,
                                             "callbacks": callbacks}))


    class Marker(ll.Callback):
        """No arguments: named by its class path alone."""

        def on_fit_end(self, fitter, state, control):
            Path("marker.txt").write_text(str(state.global_step))


    class ListLogger(Logger):
        """Keeps every row it is given and writes them to ``path`` at the end."""

        def __init__(self, path: str):
            self.path, self.rows = Path(path), []

        def log_metrics(self, metrics, step):
            self.rows.append({"step": step, **metrics})

        def finalize(self):
            self.path.write_text(json.dumps(self.rows))
''')
MODULE = "ll_cli_objects_user"  # a name no other test imports
YAML = f"""\
max_steps: 6
batch_size: 16
eval_every: 3
log_every: 2
model_summary: false
model: {{train_items: 128, val_items: 32, width: 8}}
callbacks:
  - class_path: {MODULE}.Recorder
    init_args: {{path: recorded.json, tag: from-the-file}}
  - class_path: lightlike.callbacks.EarlyStopping
    init_args: {{monitor: val/accuracy, patience: 4, mode: max}}
  - {MODULE}.Marker
loggers:
  - jsonl
  - class_path: {MODULE}:ListLogger
    init_args: {{path: rows.json}}
"""


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    """One fit through the real command line, with callbacks and a logger from a YAML file."""
    d = tmp_path_factory.mktemp("objects")
    (d / f"{MODULE}.py").write_text(OBJECTS)
    (d / "run.yaml").write_text(YAML)
    p = subprocess.run([sys.executable, "-m", "lightlike.cli", "fit", TARGET, "--config", "run.yaml",
                        "--output_dir", "out"], cwd=d, env=CLEAN, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


def test_callbacks_from_the_config_file_are_built_with_their_init_args(fit_run):
    recorded = json.loads((fit_run / "recorded.json").read_text())
    assert recorded["tag"] == "from-the-file"
    assert recorded["evaluations"] == [3, 6]  # eval_every=3 over 6 steps
    # after the built-in ones, the file's callbacks in the file's order, with the file's arguments
    assert recorded["callbacks"][-3:] == [["Recorder", {}],
                                          ["EarlyStopping", {"monitor": "val/accuracy", "patience": 4, "mode": "max"}],
                                          ["Marker", {}]]
    assert (fit_run / "marker.txt").read_text() == "6"


def test_a_logger_from_the_config_file_gets_what_the_built_in_one_gets(fit_run):
    """The class-path logger and the built-in ``jsonl`` logger of the same run: the same rows."""
    rows = json.loads((fit_run / "rows.json").read_text())
    reference = [json.loads(line) for line in (fit_run / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows and [r["step"] for r in rows] == [2, 3, 4, 6, 6]
    assert rows == [{k: v for k, v in r.items() if k not in ("time", "timestamp")} for r in reference]


# -- the resolved config: written and read back ------------------------------------------------------
def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


TOML = f"""\
max_steps = 2
loggers = ["csv", {{ class_path = "{MODULE}.ListLogger", init_args = {{ path = "rows.json" }} }}]

[[callbacks]]
class_path = "lightlike.callbacks.EarlyStopping"
init_args = {{ patience = 3 }}

[[callbacks]]
class_path = "{MODULE}.Marker"
"""
ENTRIES = {"callbacks": [{"class_path": "lightlike.callbacks.EarlyStopping", "init_args": {"patience": 3}},
                         {"class_path": f"{MODULE}.Marker", "init_args": {}}],
           "loggers": ["csv", {"class_path": f"{MODULE}.ListLogger", "init_args": {"path": "rows.json"}}]}


@pytest.mark.parametrize("fmt", ["toml", "yaml", "json"])
def test_the_config_command_writes_the_entries_it_reads_back(capsys, tmp_path, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{MODULE}.py").write_text(OBJECTS)
    (tmp_path / "in.toml").write_text(TOML)
    code, out, err = run_cli(capsys, "config", TARGET, "--config", "in.toml", "--format", fmt)
    assert code == 0, err
    (tmp_path / f"out.{fmt}").write_text(out)
    code, again, err = run_cli(capsys, "config", TARGET, "--config", f"out.{fmt}", "--format", "json")
    assert code == 0, err
    resolved = json.loads(again)
    assert {k: resolved[k] for k in ENTRIES} == ENTRIES


def test_the_callbacks_flag_replaces_the_files_list(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{MODULE}.py").write_text(OBJECTS)
    (tmp_path / "in.toml").write_text(TOML)
    code, out, err = run_cli(capsys, "config", TARGET, "--config", "in.toml", "--format", "json",
                             "--callbacks", f"{MODULE}.Marker,lightlike.callbacks.EarlyStopping")
    assert code == 0, err
    assert json.loads(out)["callbacks"] == [{"class_path": f"{MODULE}.Marker", "init_args": {}},
                                            {"class_path": "lightlike.callbacks.EarlyStopping", "init_args": {}}]


# -- a bad entry: one line naming the key and the path ---------------------------------------------------
@pytest.mark.parametrize(("yaml", "flags", "want"), [
    ("callbacks:\n  - class_path: lightlike.callbacks.EarlyStoping\n", [],
     "run.yaml: callbacks[0].class_path 'lightlike.callbacks.EarlyStoping': lightlike.callbacks has no "
     "'EarlyStoping' (did you mean 'EarlyStopping'?)"),
    ("callbacks:\n  - csv\n  - no_such_package_xyz.Callback\n", [],
     "run.yaml: callbacks[0].class_path 'csv': give the module too: package.module.ClassName"),
    ("callbacks: [no_such_package_xyz.Callback]\n", [],
     "run.yaml: callbacks[0].class_path 'no_such_package_xyz.Callback': no module 'no_such_package_xyz'"),
    ("callbacks: [collections.OrderedDict]\n", [],
     "run.yaml: callbacks[0].class_path 'collections.OrderedDict': OrderedDict is not a lightlike.Callback subclass"),
    ("callbacks:\n  - class_path: lightlike.callbacks.EarlyStopping\n    init_args: {patiense: 3}\n", [],
     "run.yaml: callbacks[0].init_args: EarlyStopping has no argument 'patiense' (did you mean 'patience'?); "
     "it takes: monitor, patience, min_delta, mode"),
    ("callbacks:\n  - class_path: lightlike.callbacks.EarlyStopping\n    init_arg: {patience: 3}\n", [],
     "run.yaml: callbacks[0]: unknown key 'init_arg' (did you mean 'init_args'?)"),
    ("callbacks:\n  - class_path: lightlike.callbacks.EarlyStopping\n    init_args: {mode: up}\n", [],
     "run.yaml: callbacks[0].init_args: EarlyStopping mode must be 'min' or 'max', got 'up'"),
    ("max_steps: 2\n", ["--loggers", "csv,lightlike.loggers.CSVLoger"],
     "--loggers: loggers[1].class_path 'lightlike.loggers.CSVLoger': lightlike.loggers has no 'CSVLoger' "
     "(did you mean 'CSVLogger'?)"),
    ("loggers: [{class_path: lightlike.callbacks.EarlyStopping}]\n", [],
     "run.yaml: loggers[0].class_path 'lightlike.callbacks.EarlyStopping': EarlyStopping is not a lightlike.Logger "
     "subclass"),
], ids=["misspelt-class", "no-module-part", "no-module", "not-a-callback", "misspelt-argument", "misspelt-entry-key",
        "refused-by-the-constructor", "logger-in-a-flag", "not-a-logger"])
def test_a_bad_entry_is_one_error_naming_the_key_and_the_path(capsys, tmp_path, monkeypatch, yaml, flags, want):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("max_steps: 2\nmodel_summary: false\n" + yaml.replace("max_steps: 2\n", ""))
    code, _, err = run_cli(capsys, "fit", TARGET, "--config", "run.yaml", "--output_dir", "out", *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"lightlike fit: error: {want}"), lines[0]
    assert not (tmp_path / "out").exists()  # refused before anything was written

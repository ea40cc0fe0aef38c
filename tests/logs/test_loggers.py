"""The logging side on its own: metrics files, TensorBoard event files read back, the model
summary, Python logging, the tqdm bar. Every test drives the real package (no mocks)."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightlike.callbacks.progress import ProgressBar
from lightlike.errors import ConfigError
from lightlike.loggers import LOGGER_NAMES, CSVLogger, JSONLLogger, Logger, build_loggers
from lightlike.loggers.console import setup_logging
from lightlike.loggers.csv import read_csv_metrics, read_jsonl_metrics
from lightlike.loggers.summary import model_summary
from lightlike.loggers.tensorboard import TensorBoardLogger
from lightlike.state import Control, FitState

NAN, INF = float("nan"), float("inf")


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


# -- CSV / JSONL -------------------------------------------------------------------------------
def test_csv_long_format_changing_keys_nonfinite_and_flushed_per_call(tmp_path):
    lg = CSVLogger(tmp_path)
    lg.log_metrics({"train/loss": 0.5, "train/lr": 1e-3}, 1)
    lg.log_metrics({"val/acc": NAN, "val/loss": INF}, 2)
    lg.log_metrics({"weird,name": -INF, "n": torch.tensor(2.5)}, 3)  # type: ignore[dict-item]
    # read while still open: every call was flushed
    text = (tmp_path / "metrics.csv").read_text()
    assert text.splitlines()[0] == "step,name,value"
    assert "2,val/acc,nan" in text and "2,val/loss,inf" in text and '3,"weird,name",-inf' in text
    rows = read_csv_metrics(tmp_path / "metrics.csv")
    assert [(s, n) for s, n, _ in rows] == [(1, "train/loss"), (1, "train/lr"), (2, "val/acc"),
                                            (2, "val/loss"), (3, "weird,name"), (3, "n")]
    values = [v for _, _, v in rows]
    assert values[:2] == [0.5, 1e-3] and math.isnan(values[2])
    assert values[3] == INF and values[4] == -INF and values[5] == 2.5
    lg.finalize()
    lg.finalize()  # idempotent
    lg.log_metrics({"train/loss": 0.25}, 4)  # reopens in append mode, no second header
    lg.finalize()
    text = (tmp_path / "metrics.csv").read_text()
    assert text.count("step,name,value") == 1 and text.endswith("4,train/loss,0.25\n")


def test_jsonl_one_object_per_call_with_nan_literals(tmp_path):
    lg = JSONLLogger(tmp_path)
    lg.log_metrics({"train/loss": 0.5, "train/lr": 1e-3}, 1)
    lg.log_metrics({"val/acc": NAN, "val/loss": INF, "val/neg": -INF}, 2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # flushed, still open
    assert len(lines) == 2
    assert "NaN" in lines[1] and '"val/loss": Infinity' in lines[1] and "-Infinity" in lines[1]
    objs = [json.loads(x) for x in lines]
    assert objs[0] == {"step": 1, "train/loss": 0.5, "train/lr": 1e-3}
    assert objs[1]["step"] == 2 and math.isnan(objs[1]["val/acc"])
    assert objs[1]["val/loss"] == INF and objs[1]["val/neg"] == -INF
    lg.finalize()
    assert [o["step"] for o in read_jsonl_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def _steps_and_values(cls, path):
    if cls is CSVLogger:
        rows = read_csv_metrics(path)
        return [s for s, n, _ in rows if n == "loss"], {s: v for s, n, v in rows if n == "loss"}, \
            [s for s, n, _ in rows if n == "aux"]
    objs = read_jsonl_metrics(path)
    return [o["step"] for o in objs], {o["step"]: o["loss"] for o in objs}, [o["step"] for o in objs]


@pytest.mark.parametrize("cls", [CSVLogger, JSONLLogger])
def test_resume_truncates_to_the_checkpoint_step(tmp_path, cls):
    lg = cls(tmp_path)
    for step in range(1, 11):
        lg.log_metrics({"loss": float(step), "aux": NAN if step == 3 else 0.0}, step)
    lg.finalize()
    lg = cls(tmp_path)
    lg.resume(5)
    for step in range(6, 9):
        lg.log_metrics({"loss": 100.0 + step, "aux": 0.0}, step)
    lg.finalize()
    steps, values, aux_steps = _steps_and_values(cls, lg.path)
    assert steps == list(range(1, 9)) and aux_steps == list(range(1, 9))
    assert values == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 106.0, 7: 107.0, 8: 108.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == [lg.path.name]  # no temp file left


@pytest.mark.parametrize("cls", [CSVLogger, JSONLLogger])
def test_resume_on_an_open_logger_and_without_a_file(tmp_path, cls):
    lg = cls(tmp_path / "a")
    for step in range(1, 5):
        lg.log_metrics({"loss": float(step), "aux": 1.0}, step)
    lg.resume(2)  # closes the open handle first
    lg.log_metrics({"loss": 33.0, "aux": 1.0}, 3)
    lg.finalize()
    steps, values, _ = _steps_and_values(cls, lg.path)
    assert steps == [1, 2, 3] and values[3] == 33.0
    fresh = cls(tmp_path / "b")
    fresh.resume(7)  # nothing on disk: nothing to do
    assert not fresh.path.exists()
    fresh.log_metrics({"loss": 8.0, "aux": 0.0}, 8)
    fresh.finalize()
    assert _steps_and_values(cls, fresh.path)[0] == [8]


@pytest.mark.parametrize("cls", [CSVLogger, JSONLLogger])
def test_resume_drops_a_torn_last_line(tmp_path, cls):
    """A process killed mid-write leaves a line without newline; resume must not glue the next
    row onto it."""
    lg = cls(tmp_path)
    for step in range(1, 6):
        lg.log_metrics({"loss": float(step), "aux": 0.0}, step)
    lg.finalize()
    with open(lg.path, "a") as fh:
        fh.write("4,loss,0.1" if cls is CSVLogger else '{"step": 4, "loss": 0.1')
    lg = cls(tmp_path)
    lg.resume(5)
    lg.log_metrics({"loss": 6.0, "aux": 0.0}, 6)
    lg.finalize()
    steps, values, _ = _steps_and_values(cls, lg.path)
    assert steps == [1, 2, 3, 4, 5, 6] and values[4] == 4.0


# -- TensorBoard -------------------------------------------------------------------------------
def _accumulator(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = _accumulator(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _texts(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    acc = _accumulator(log_dir)
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def test_tensorboard_scalars_read_back(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the event file is created on the first write
    for step in (1, 2, 3):
        lg.log_metrics({"train/loss": 1.0 / step, "train/lr": 1e-3 * step}, step)
    lg.log_metrics({"val/acc": 0.75, "val/odd": NAN}, 3)
    lg.log_text("notes", "hello **tb**", 2)
    lg.finalize()
    scalars = _scalars(tmp_path)
    assert sorted(scalars) == ["train/loss", "train/lr", "val/acc", "val/odd"]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([1.0, 0.5, 1 / 3], rel=1e-6)
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([1e-3, 2e-3, 3e-3], rel=1e-6)
    assert scalars["val/acc"] == [(3, 0.75)]
    assert scalars["val/odd"][0][0] == 3 and math.isnan(scalars["val/odd"][0][1])
    assert _texts(tmp_path, "notes") == [(2, "hello **tb**")]


def test_tensorboard_resume_purges_later_steps_across_writers(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    lg.log_hyperparams({"lr": 0.1, "layers": [1, 2], "name": "a|b", "none": None, "nested": {"k": 1}})
    for step in range(1, 11):
        lg.log_metrics({"loss": float(step)}, step)
    lg.finalize()
    lg = TensorBoardLogger(tmp_path)
    lg.resume(5)
    lg.log_hyperparams({"lr": 0.2})
    for step in range(6, 9):
        lg.log_metrics({"loss": 100.0 + step}, step)
    lg.finalize()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    # EventAccumulator (purge_orphaned_data=True, the default) honours the purge marker the
    # second writer wrote at step 6: the first file's steps >= 6 are dropped
    assert _scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0),
                                         (6, 106.0), (7, 107.0), (8, 108.0)]
    # and the reader the TensorBoard server runs with --load_fast=false, which took the purge
    # marker for the run's start and kept steps 6-8 twice
    from tensorboard.backend.event_processing import plugin_event_accumulator

    acc = plugin_event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("loss")] == [1, 2, 3, 4, 5, 6, 7, 8]
    texts = _texts(tmp_path, "config")
    assert [s for s, _ in texts] == [0, 6]  # one config per run segment, none duplicated
    first, second = texts[0][1], texts[1][1]
    assert "| layers | [1, 2] |" in first and "| name | a\\|b |" in first and "| none | None |" in first
    assert "| nested | {'k': 1} |" in first and "| lr | 0.2 |" in second


def test_tensorboard_files_sort_in_the_order_they_were_opened(tmp_path, monkeypatch):
    """Kill and resume in one process within one second, the file counter going from 9 to 10:
    the names sorted '.10' before '.9', TensorBoard read the resumed file first, and its purge
    marker never hid the old file's step 3 (shown twice)."""
    import itertools

    from lightlike.loggers import tensorboard

    monkeypatch.setattr(tensorboard, "_file_ids", itertools.count(9))
    a = TensorBoardLogger(tmp_path)
    for step in (1, 2, 3):
        a.log_metrics({"loss": float(step)}, step)
    a.finalize()
    b = TensorBoardLogger(tmp_path)
    b.resume(2)
    for step in (3, 4):
        b.log_metrics({"loss": 10.0 + step}, step)
    b.finalize()
    assert _scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_tensorboard_resume_after_writes_and_reopen_do_not_purge_twice(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    for step in range(1, 5):
        lg.log_metrics({"loss": float(step)}, step)
    lg.resume(2)  # an open writer: closed, the next file purges steps >= 3
    for step in (3, 4):
        lg.log_metrics({"loss": 30.0 + step}, step)
    lg.finalize()
    lg.log_metrics({"loss": 5.0}, 5)  # a new writer after finalize must not purge 3..4 again
    lg.finalize()
    assert _scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 33.0), (4, 34.0), (5, 5.0)]


def test_tensorboard_missing_gives_the_install_hint_and_auto_falls_back():
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from lightlike.loggers import build_loggers\n"
        "from lightlike.loggers.tensorboard import TensorBoardLogger\n"
        "import tempfile\n"
        "try:\n    TensorBoardLogger(tempfile.mkdtemp())\nexcept ImportError as e:\n    print('ERR', e)\n"
        "print('AUTO', [type(x).__name__ for x in build_loggers('auto', tempfile.mkdtemp())])\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "ERR the TensorBoard logger needs the tensorboard package: pip install 'lightlike[tensorboard]'" in out.stdout
    assert "AUTO ['CSVLogger']" in out.stdout
    assert "tensorboard is not installed: logging to CSV only" in out.stderr


# -- build_loggers -----------------------------------------------------------------------------
def test_build_loggers_specs(tmp_path):
    auto = build_loggers("auto", str(tmp_path))
    assert [type(x).__name__ for x in auto] == ["CSVLogger", "TensorBoardLogger"]
    assert auto[0].path == tmp_path / "logs" / "metrics.csv" and auto[1].log_dir == str(tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # building writes nothing
    mine = CSVLogger(tmp_path / "elsewhere")
    built = build_loggers(("jsonl", mine, "csv"), tmp_path)
    assert [type(x).__name__ for x in built] == ["JSONLLogger", "CSVLogger", "CSVLogger"] and built[1] is mine
    assert built[0].path == tmp_path / "logs" / "metrics.jsonl"
    assert [type(x).__name__ for x in build_loggers("csv,jsonl", tmp_path)] == ["CSVLogger", "JSONLLogger"]
    assert build_loggers([], tmp_path) == [] and build_loggers(None, tmp_path) == []
    assert build_loggers("auto", tmp_path, enabled=False) == []
    assert build_loggers(["csv", "tensorboard"], tmp_path, enabled=False) == []
    assert LOGGER_NAMES == ("csv", "jsonl", "tensorboard", "wandb", "mlflow", "comet", "neptune")


def test_build_loggers_errors(tmp_path):
    valid = "valid names: csv, jsonl, tensorboard, wandb, mlflow, comet, neptune"
    with pytest.raises(ConfigError, match=r"unknown logger 'tensorbord' \(did you mean 'tensorboard'\?\); " + valid):
        build_loggers(["csv", "tensorbord"], str(tmp_path))
    with pytest.raises(ConfigError, match=r"unknown logger 'aim'; " + valid):
        build_loggers(["aim"], str(tmp_path))
    # checked on every rank, so a bad spec fails everywhere alike instead of only on rank 0
    with pytest.raises(ConfigError, match="did you mean 'jsonl'"):
        build_loggers(["json"], str(tmp_path), enabled=False)
    with pytest.raises(ConfigError, match="listed twice"):
        build_loggers(["csv", "csv"], str(tmp_path))
    with pytest.raises(ConfigError, match="got int"):
        build_loggers(["csv", 3], str(tmp_path))
    with pytest.raises(ConfigError, match="loggers must be"):
        build_loggers(3, str(tmp_path))


def test_custom_logger_contract():
    class Broken(Logger):
        pass

    with pytest.raises(NotImplementedError, match="Broken must implement log_metrics"):
        Broken().log_metrics({"a": 1.0}, 1)
    Broken().resume(3)  # the other hooks default to no-ops
    Broken().log_text("t", "x", 1)
    Broken().log_hyperparams({})
    Broken().attach(Path("logs"), {})
    Broken().log_result(None)
    Broken().finalize()


# -- model summary -------------------------------------------------------------------------------
def _rows(text: str) -> dict[str, tuple[str, int, int]]:
    lines = text.splitlines()
    body = lines[2:lines.index(lines[1], 2)]  # between the two rules
    out = {}
    for line in body:
        name, typ, params, trainable = line.split()
        out[name] = (typ, int(params.replace(",", "")), int(trainable.replace(",", "")))
    return out


def test_model_summary_counts_zero3_partitioned_parameters_whole():
    """Under ZeRO-3 a parameter holds an empty local tensor and its size in ds_numel (DeepSpeed's
    attribute): the table said 0 parameters on every ZeRO-3 run."""
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 3))
    for p in net.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert "total params: 515  trainable: 515" in model_summary(net)


def test_model_summary_counts_rows_and_totals():
    text = model_summary(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    assert _rows(text) == {"0": ("Linear", 15, 15), "1": ("ReLU", 0, 0), "2": ("Linear", 8, 8)}
    assert text.splitlines()[0].split() == ["name", "type", "params", "trainable"]
    assert "total params: 23  trainable: 23  non-trainable: 0  size: 0.00 MB" in text


def test_model_summary_tied_weights_frozen_and_own_parameters():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1024, 512)
            self.body = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512))
            self.head = nn.Linear(512, 1024, bias=False)
            self.head.weight = self.emb.weight  # tied: counted once, under emb
            self.scale = nn.Parameter(torch.ones(3))
            self.body[1].requires_grad_(False)

    text = model_summary(Tied())
    emb, lin, norm = 1024 * 512, 512 * 512 + 512, 2 * 512
    assert _rows(text) == {"emb": ("Embedding", emb, emb), "body": ("Sequential", lin + norm, lin),
                           "head": ("Linear", 0, 0), "(own)": ("Parameter", 3, 3)}
    total = emb + lin + norm + 3
    assert f"total params: {total:,}  trainable: {total - norm:,}  non-trainable: {norm:,}" in text
    assert f"size: {total * 4 / 2**20:.2f} MB" in text  # 4 bytes per float32 element, tied once

    deep = _rows(model_summary(Tied(), max_depth=2))
    assert deep["body.0"] == ("Linear", lin, lin) and deep["body.1"] == ("LayerNorm", norm, 0)
    assert deep["body"] == ("Sequential", lin + norm, lin) and "emb" in deep
    half = model_summary(nn.Linear(1024, 1024, bias=False).half())
    assert "size: 2.00 MB" in half and "total params: 1,048,576" in half
    with pytest.raises(ValueError, match="max_depth"):
        model_summary(Tied(), max_depth=0)


# -- Python logging ------------------------------------------------------------------------------
@pytest.fixture
def restore_lightlike_logger():
    lg = logging.getLogger("lightlike")
    level, handlers = lg.level, list(lg.handlers)
    yield lg
    lg.setLevel(level)
    lg.handlers[:] = handlers


def test_setup_logging_levels_and_single_handler(restore_lightlike_logger, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # an application that configured no logging
    lg = setup_logging("debug", True)
    assert lg is restore_lightlike_logger and lg.level == logging.DEBUG
    ours = [h for h in lg.handlers if getattr(h, "_lightlike", False)]
    for _ in range(3):
        setup_logging("INFO", True)
    assert [h for h in lg.handlers if getattr(h, "_lightlike", False)] == ours and len(ours) == 1
    assert lg.level == logging.INFO
    assert setup_logging("debug", False).level == logging.WARNING  # other ranks: log_level_other_ranks
    assert setup_logging("debug", False, "error").level == logging.ERROR
    setup_logging("info", True)
    capsys.readouterr()
    lg.info("hello %d", 7)
    lg.debug("hidden")
    assert "[lightlike INFO] hello 7\n" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"log_level='loud' is not valid; choose one of: debug, info, warning"):
        setup_logging("loud", True)


def test_an_application_that_configured_logging_gets_each_line_once():
    """With the application's own handler (logging.basicConfig), lightlike adds none: every line
    printed twice before, once as '[lightlike INFO] ...' and once in the application's format."""
    code = f"""
import logging, sys, tempfile
logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s", stream=sys.stderr)
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from helpers import Classifier, DictDataset
import lightlike as ll
ll.Fitter(max_steps=2, batch_size=4, log_every=1, loggers=[], model_summary=False,
          output_dir=tempfile.mkdtemp()).fit(Classifier(), DictDataset(n=8))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.count("step 1/2") == 1 and "APP lightlike step 1/2" in p.stderr, p.stderr[-2000:]
    assert "[lightlike" not in p.stderr


# -- progress bar --------------------------------------------------------------------------------
def _drive(bar: ProgressBar, state: FitState, steps: int, metrics: dict[str, float]) -> None:
    fitter, control = SimpleNamespace(), Control()
    bar.on_fit_start(fitter, state, control)
    for _ in range(steps):
        state.global_step += 1
        bar.on_step_end(fitter, state, control)
    bar.on_log(fitter, state, control, metrics)
    bar.on_evaluate(fitter, state, control, {"val/loss": 0.5, "val/acc": 0.75})
    bar.on_fit_end(fitter, state, control)


def test_progress_bar_with_real_tqdm():
    buf = io.StringIO()
    bar = ProgressBar(enabled=True, file=buf)
    assert bar.active()
    _drive(bar, FitState(max_steps=10), 10, {"train/loss": 1.2345678, "train/lr": 2e-5, "train/epoch": 1.0})
    text = buf.getvalue()
    assert "10/10" in text and "loss=1.235" in text and "lr=2e-05" in text and "epoch" not in text
    assert "step 10: val/loss=0.5  val/acc=0.75" in text
    assert bar.bar is None  # closed


def test_progress_bar_resumes_at_the_global_step():
    buf = io.StringIO()
    _drive(ProgressBar(enabled=True, file=buf), FitState(global_step=4, max_steps=10), 6, {"train/loss": NAN})
    text = buf.getvalue()
    assert " 4/10" in text and "10/10" in text and "loss=nan" in text
    assert "1/10" not in text and "11/10" not in text


def test_progress_bar_closes_on_exception():
    buf = io.StringIO()
    bar = ProgressBar(enabled=True, file=buf)
    state = FitState(max_steps=5)
    bar.on_fit_start(SimpleNamespace(), state, Control())
    assert bar.bar is not None
    bar.on_exception(SimpleNamespace(), state, Control(), RuntimeError("x"))
    assert bar.bar is None and "0/5" in buf.getvalue()


def test_progress_bar_off_when_not_a_tty_or_disabled():
    class TTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert ProgressBar(enabled=None, file=TTY()).active()
    for enabled in (None, False):
        buf = io.StringIO()
        bar = ProgressBar(enabled=enabled, file=buf)
        assert not bar.active()
        _drive(bar, FitState(max_steps=3), 3, {"train/loss": 1.0})
        assert buf.getvalue() == "" and bar.bar is None


def test_progress_bar_without_tqdm():
    code = (
        "import sys, io; sys.modules['tqdm'] = None\n"
        "from types import SimpleNamespace as NS\n"
        "from lightlike.callbacks.progress import ProgressBar\n"
        "from lightlike.state import FitState, Control\n"
        "class TTY(io.StringIO):\n    def isatty(self): return True\n"
        "s, c = FitState(max_steps=2), Control()\n"
        "off = ProgressBar(enabled=False); off.on_fit_start(NS(), s, c); off.on_step_end(NS(), s, c)\n"
        "auto = ProgressBar(enabled=None, file=TTY()); auto.on_fit_start(NS(), s, c)\n"
        "print('AUTO', auto.bar)\n"
        "try:\n    ProgressBar(enabled=True).on_fit_start(NS(), s, c)\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "AUTO None" in out.stdout and "tqdm is not installed: no progress bar" in out.stderr
    assert "ERR ProgressBar(enabled=True) needs tqdm: pip install tqdm" in out.stdout


def test_importing_loggers_and_progress_loads_neither_tensorboard_nor_tqdm():  # nor wandb, mlflow, comet, neptune
    """torch itself imports tqdm (through torch.hub), so tqdm is judged against what
    ``import torch`` loaded; tensorboard must be absent outright."""
    code = ("import sys, torch; before = set(sys.modules); "
            "import lightlike.loggers, lightlike.loggers.tensorboard, lightlike.loggers.summary, "
            "lightlike.loggers.console, lightlike.callbacks.progress, lightlike.loggers.wandb, lightlike.loggers.mlflow, "
            "lightlike.loggers.comet, lightlike.loggers.neptune; "
            "tb = [m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'wandb', 'mlflow', 'comet_ml', 'neptune') "
            "or 'utils.tensorboard' in m]; "
            "new = [m for m in sys.modules if m not in before and m.split('.')[0] == 'tqdm']; "
            "print(sorted(tb + new))")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


_FIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
{prelude}
import lightlike as ll
import warnings
from helpers import Classifier, DictDataset
class Warn(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 2:
            warnings.warn("a warning during the fit")
ll.Fitter(max_steps=6, batch_size=4, log_every=3, output_dir={out!r}, loggers=[], model_summary=False,
          save_every=3, callbacks=[Warn()]).fit(Classifier(), DictDataset(n=24))
"""


def _on_pty(code: list[str], columns: int = 100) -> str:
    """What ``code`` writes to its stderr, a pseudo-terminal of ``columns`` columns."""
    import fcntl
    import pty
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(code, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=120) == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode(errors="replace")


def test_the_fitter_shows_a_bar_on_a_terminal_and_log_lines_elsewhere(tmp_path):
    """A real fit in a subprocess, its stderr once a pseudo-terminal and once a pipe: on the
    terminal tqdm draws the bar (and no per-log line), and log lines during the fit (a saved
    checkpoint) go above it, each on a line of its own (they were written onto the bar's line);
    through the pipe there is no bar, and each log step is a line."""
    import re

    tests = str(Path(__file__).parents[1])
    for columns in (100, 0):  # a sized terminal, and one that reports no size (tqdm drew nothing there)
        on_tty = _on_pty([sys.executable, "-c", _FIT_SCRIPT.format(tests=tests, prelude="",
                                                                  out=str(tmp_path / f"tty{columns}"))], columns)
        assert "fit: 100%" in on_tty and "6/6" in on_tty and "step 3/6" not in on_tty, (columns, on_tty[-2000:])
        assert on_tty.count("saved checkpoint") == 2
        assert not re.search(r"[^\r\n]\[lightlike", on_tty), on_tty[-2000:]
        # Python's warnings are left alone (printed by warnings.showwarning, not the bar's writer)
        assert re.search(r"<string>:\d+: UserWarning: a warning during the fit", on_tty), on_tty[-2000:]
    # a terminal, but no tqdm: no bar, so the log lines it would have replaced are written
    no_tqdm = _on_pty([sys.executable, "-c", _FIT_SCRIPT.format(
        tests=tests, prelude="sys.modules['tqdm'] = None", out=str(tmp_path / "notqdm"))])
    assert "tqdm is not installed" in no_tqdm and "step 3/6" in no_tqdm and "step 6/6" in no_tqdm
    piped = subprocess.run([sys.executable, "-c", _FIT_SCRIPT.format(tests=tests, prelude="",
                                                                     out=str(tmp_path / "pipe"))],
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert "fit:" not in piped.stderr and "step 3/6" in piped.stderr and "step 6/6" in piped.stderr


def test_an_application_s_logging_goes_above_the_bar_and_keeps_its_warnings(tmp_path):
    """With the application's console handler (``logging.basicConfig``), lightlike's lines were
    printed onto the bar's line (only lightlike's own handler knew of the bar); with
    ``logging.captureWarnings(True)`` the bar took the warnings the application sends to its log."""
    import re

    tests = str(Path(__file__).parents[1])
    prelude = "import logging; logging.basicConfig(level=logging.INFO, format='APP %(name)s: %(message)s')"
    on_tty = _on_pty([sys.executable, "-c", _FIT_SCRIPT.format(tests=tests, prelude=prelude, out=str(tmp_path / "a"))])
    assert "fit: 100%" in on_tty and on_tty.count("APP lightlike: saved checkpoint") == 2, on_tty[-2000:]
    assert not re.search(r"[^\r\n]APP lightlike", on_tty), on_tty[-2000:]  # each at the start of a line
    assert "[lightlike" not in on_tty

    log_file = tmp_path / "app.log"
    prelude = (f"import logging; logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO); "
               "logging.captureWarnings(True)")
    on_tty = _on_pty([sys.executable, "-c", _FIT_SCRIPT.format(tests=tests, prelude=prelude, out=str(tmp_path / "b"))])
    assert "fit: 100%" in on_tty and "a warning during the fit" not in on_tty, on_tty[-2000:]
    assert "UserWarning: a warning during the fit" in log_file.read_text()


def test_logger_instances_in_loggers_are_saved_by_class_name(tmp_path):
    """``loggers=["jsonl", CSVLogger(...), Mine()]`` is accepted at construction, but the first
    checkpoint raised 'Object of type CSVLogger is not JSON serializable' (the config is saved)."""
    from helpers import Classifier, DictDataset

    import lightlike as ll

    class Mine(Logger):
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append(step)

    mine = Mine()
    out = tmp_path / "run"
    result = ll.Fitter(max_steps=4, batch_size=4, log_every=2, save_every=2, output_dir=str(out), model_summary=False,
                       loggers=["jsonl", CSVLogger(tmp_path / "csv"), mine]).fit(Classifier(), DictDataset(n=16))
    assert result.global_step == 4 and mine.rows == [2, 4]
    saved = json.loads((out / "checkpoint-4" / "config.json").read_text())
    assert saved["loggers"] == ["jsonl", "CSVLogger", "Mine"]
    assert [s for s, name, _ in read_csv_metrics(tmp_path / "csv" / "metrics.csv") if name == "train/loss"] == [2, 4]


def test_a_bar_leaves_recorded_warnings_to_the_recorder(tmp_path):
    """``pytest.warns`` / ``catch_warnings(record=True)`` around a fit with a bar: the bar printed
    the warning above itself and the recorder saw nothing ('DID NOT WARN')."""
    import warnings

    from helpers import Classifier, DictDataset

    import lightlike as ll

    class Warn(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 2:
                warnings.warn("from a callback", UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="from a callback"):
        ll.Fitter(max_steps=3, batch_size=4, output_dir=str(tmp_path / "o"), loggers=[], progress_bar=True,
                  save_strategy="no", model_summary=False, callbacks=[Warn()]).fit(Classifier(), DictDataset(n=32))


def test_an_application_s_handler_stays_its_own_while_the_bar_shows(tmp_path):
    """The bar's writer stands in for the handler's stream, not for the handler: a handler the
    application removes or quietens during the fit is removed or quiet (swapping the handler
    object for a wrapper kept printing through it, and put a removed one back after the fit)."""
    code = f"""
import logging, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import lightlike as ll
from helpers import Classifier, DictDataset
logging.basicConfig(level=logging.INFO, format="APP %(message)s", stream=sys.stderr)
app = logging.getLogger("app")
handler = logging.getLogger().handlers[0]

class Change(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 1:
            app.info("shown above the bar")
            handler.setLevel(logging.ERROR)
            app.info("quietened: not shown")
            handler.setLevel(logging.INFO)
            logging.getLogger().removeHandler(handler)
            app.info("removed: not shown")

ll.Fitter(max_steps=2, batch_size=4, output_dir={str(tmp_path / "o")!r}, loggers=[], progress_bar=True,
          save_strategy="no", model_summary=False, callbacks=[Change()]).fit(Classifier(), DictDataset(n=16))
app.info("after the fit: not shown either")  # (lastResort prints warnings only)
print(handler.stream is sys.stderr, handler in logging.getLogger().handlers)
"""
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "APP shown above the bar" in p.stderr and "not shown" not in p.stderr, p.stderr[-3000:]
    assert p.stdout.split() == ["True", "False"]  # its own stream back, and still removed

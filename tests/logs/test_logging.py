"""Logging drives the real things: TensorBoard event files read back, CSV/JSONL, tqdm, summary."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import Classifier, DictDataset, HostReads
from torch import nn

import lightlike as ll
from lightlike.callbacks.progress import ProgressBar
from lightlike.loggers import CSVLogger, JSONLLogger, build_loggers
from lightlike.loggers.console import setup_logging
from lightlike.loggers.csv import read_csv_metrics
from lightlike.loggers.summary import model_summary
from lightlike.loggers.tensorboard import TensorBoardLogger


def tb_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_fit_writes_tensorboard_and_csv_with_the_logged_numbers(tmp_path):
    out = tmp_path / "run"
    result = ll.Fitter(max_steps=6, batch_size=4, log_every=2, eval_every=3, output_dir=str(out),
                       loggers=["csv", "jsonl", "tensorboard"]).fit(Classifier(), DictDataset(n=40), DictDataset(n=8))
    history = [h for h in result.state.log_history if "train/loss" in h]
    assert [h["step"] for h in history] == [2, 4, 6]
    scalars = tb_scalars(out / "logs")
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6]
    for (_step, value), h in zip(scalars["train/loss"], history, strict=True):
        assert value == pytest.approx(h["train/loss"], rel=1e-6)
    assert [s for s, _ in scalars["val/accuracy"]] == [3, 6]
    rows = read_csv_metrics(out / "logs" / "metrics.csv")
    csv_loss = [(s, v) for s, n, v in rows if n == "train/loss"]
    assert csv_loss == [(h["step"], h["train/loss"]) for h in history]
    lines = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train/loss" in x] == [2, 4, 6]


KILLED_AFTER_A_CHECKPOINT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import lightlike as ll
from helpers import Classifier, DictDataset

class Kill(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 8:
            os.kill(os.getpid(), signal.SIGKILL)

ll.Fitter(max_steps=12, batch_size=4, log_every=1, save_every=5, output_dir={out!r}, loggers=["tensorboard"],
          log_level="warning", callbacks=[] if {resume} else [Kill()]).fit(Classifier(), DictDataset(n=40), resume={resume})
"""


def test_tensorboard_steps_up_to_a_checkpoint_survive_a_kill_and_resume_continues(tmp_path):
    """The event file is buffered; every checkpoint flushes it first. SIGKILL at step 8, after
    the checkpoint at step 5: steps 1..5 are on disk, and the resumed run (purging > 5) shows
    every step 1..12 once."""
    from pathlib import Path

    out = tmp_path / "run"
    tests = str(Path(__file__).parents[1])
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_A_CHECKPOINT.format(tests=tests, out=str(out), resume=False)],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    steps = [s for s, _ in tb_scalars(out / "logs")["train/loss"]]
    assert steps[:5] == [1, 2, 3, 4, 5]
    resumed = subprocess.run([sys.executable, "-c", KILLED_AFTER_A_CHECKPOINT.format(tests=tests, out=str(out), resume=True)],
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert [s for s, _ in tb_scalars(out / "logs")["train/loss"]] == list(range(1, 13))


def test_csv_and_jsonl_keep_nan_and_resume_without_duplicates(tmp_path):
    for cls in (CSVLogger, JSONLLogger):
        lg = cls(tmp_path / cls.__name__)
        for step in range(1, 11):
            lg.log_metrics({"loss": float(step), "odd": float("nan") if step == 3 else 0.0}, step)
        lg.finalize()
        lg = cls(tmp_path / cls.__name__)
        lg.resume(5)
        for step in range(6, 9):
            lg.log_metrics({"loss": 100.0 + step, "odd": 0.0}, step)
        lg.finalize()
        if cls is CSVLogger:
            rows = read_csv_metrics(lg.path)
            steps = [s for s, n, _ in rows if n == "loss"]
            nan_rows = [v for s, n, v in rows if n == "odd" and s == 3]
            values = {s: v for s, n, v in rows if n == "loss"}
        else:
            objs = [json.loads(x) for x in lg.path.read_text().splitlines()]
            steps = [o["step"] for o in objs]
            nan_rows = [o["odd"] for o in objs if o["step"] == 3]
            values = {o["step"]: o["loss"] for o in objs}
        assert steps == list(range(1, 9)), cls.__name__
        assert math.isnan(nan_rows[0])
        assert values[5] == 5.0 and values[6] == 106.0


def test_tensorboard_resume_purges_later_steps(tmp_path):
    lg = TensorBoardLogger(tmp_path)
    for step in range(1, 11):
        lg.log_metrics({"loss": float(step)}, step)
    lg.finalize()
    lg = TensorBoardLogger(tmp_path)
    lg.resume(5)
    for step in range(6, 9):
        lg.log_metrics({"loss": 100.0 + step}, step)
    lg.finalize()
    scalars = tb_scalars(tmp_path)["loss"]
    assert [s for s, _ in scalars] == list(range(1, 9))
    assert dict(scalars)[6] == 106.0 and dict(scalars)[5] == 5.0


def test_build_loggers_errors_and_auto(tmp_path):
    with pytest.raises(ll.ConfigError, match=r"unknown logger 'tensorbord' \(did you mean 'tensorboard'\?\)"):
        build_loggers(["tensorbord"], str(tmp_path))
    names = [type(x).__name__ for x in build_loggers("auto", str(tmp_path))]
    assert names == ["CSVLogger", "TensorBoardLogger"]
    assert build_loggers("auto", str(tmp_path), enabled=False) == []
    assert build_loggers([], str(tmp_path)) == []


def test_model_summary_counts():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.b = nn.Linear(3, 2)
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight  # tied
            self.b.bias.requires_grad_(False)

    text = model_summary(Tied())
    # 15 + 8 + 20, the tied head adds nothing; b.bias (2) frozen
    assert "total params: 43  trainable: 41  non-trainable: 2" in text
    assert "a" in text and "Linear" in text and "Embedding" in text


def test_setup_logging_levels():
    lg = setup_logging("debug", True)
    assert lg.level == 10
    handlers = len(lg.handlers)
    setup_logging("info", True)
    assert len(lg.handlers) == handlers
    assert setup_logging("info", False).level == 30
    with pytest.raises(ll.ConfigError, match="log_level='loud'"):
        setup_logging("loud", True)
    setup_logging("info", True)


def test_progress_bar_real_tqdm():
    buf = io.StringIO()
    bar = ProgressBar(enabled=True, file=buf)
    state, control, fitter = ll.FitState(max_steps=10), ll.Control(), SimpleNamespace()
    bar.on_fit_start(fitter, state, control)
    for step in range(1, 11):
        state.global_step = step
        bar.on_step_end(fitter, state, control)
        if step == 10:
            bar.on_log(fitter, state, control, {"train/loss": 0.12345, "train/lr": 0.001})
    bar.on_evaluate(fitter, state, control, {"val/loss": 0.5})
    bar.on_fit_end(fitter, state, control)
    text = buf.getvalue()
    assert "10/10" in text and "step 10: val/loss=0.5" in text


def test_progress_bar_off_when_not_a_tty():
    buf = io.StringIO()
    bar = ProgressBar(enabled=None, file=buf)
    assert not bar.active()
    bar.on_fit_start(SimpleNamespace(), ll.FitState(max_steps=3), ll.Control())
    assert buf.getvalue() == "" and bar.bar is None


def test_import_is_light():
    """`import lightlike` adds none of tensorboard, tqdm, DCP or deepspeed to what torch loads."""
    code = ("import sys, torch; before = set(sys.modules); import lightlike; "
            "heavy = [m for m in ('tensorboard', 'tqdm', 'deepspeed', 'torch.distributed.checkpoint', "
            "'torch.utils.tensorboard') if m in sys.modules and m not in before]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_model_summary_logged_at_fit_start(tmp_path, caplog):
    with caplog.at_level("INFO", logger="lightlike"):
        ll.Fitter(max_steps=1, batch_size=4, output_dir=str(tmp_path), loggers=[]).fit(Classifier(), DictDataset(n=8))
    assert "model summary" in caplog.text and "total params: 195" in caplog.text
    torch.manual_seed(0)


def test_no_host_read_of_a_tensor_between_log_steps(tmp_path, monkeypatch):
    """The hot path keeps losses on the device: no tensor is read to the host (``.item()``,
    ``float()``, ``bool()``, ...; each a device sync on a GPU) on a step that does not log.
    Counted between the start of step 2 and the end of step 9, with logging every 10 steps and
    the default settings (loss checks, grad norm for the log, schedule, CSV + TensorBoard), inside
    one epoch (starting an epoch's iterator reads CPU tensors of the sampler: no device there)."""
    counter = HostReads(first=2, last=9)
    counter.install(monkeypatch)
    # a hand loop's read is seen: the counter works
    counter.watching = True
    float(torch.ones(()))
    assert counter.reads == ["__float__"]
    counter.reads.clear()
    counter.watching = False
    ll.Fitter(max_steps=12, batch_size=4, grad_accum_steps=2, max_grad_norm=1.0, log_every=10, warmup_steps=3,
              output_dir=str(tmp_path), callbacks=[counter]).fit(Classifier(), DictDataset(n=160))
    assert counter.reads == []
    # and a log step does read (one batched read of the pending losses)
    counter.watching = True
    ll.Fitter(max_steps=2, batch_size=4, log_every=1, output_dir=str(tmp_path / "b"), loggers=[]
              ).fit(Classifier(), DictDataset(n=64))
    assert counter.reads


def test_grad_norm_in_every_scheduled_row_and_the_last(tmp_path):
    """The norm is taken at log steps and at the last step (a run whose max_steps is not a multiple
    of log_every ended on a row without it), equal to clip_grad_norm_'s on the same gradients."""
    norms = {}

    class Norms(ll.Callback):
        def on_before_optimizer_step(self, fitter, state, control, optimizer):
            grads = [p.grad for p in fitter.module.parameters()]
            norms[state.global_step + 1] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()

    rows = {}

    class Rows(ll.Callback):
        def on_log(self, fitter, state, control, metrics):
            rows[state.global_step] = metrics.get("train/grad_norm")

    ll.Fitter(max_steps=5, batch_size=4, log_every=2, output_dir=str(tmp_path), loggers=[],
              callbacks=[Norms(), Rows()]).fit(Classifier(), DictDataset(n=40))
    assert sorted(rows) == [2, 4, 5]
    for step, value in rows.items():
        assert value == pytest.approx(norms[step], rel=1e-6), step

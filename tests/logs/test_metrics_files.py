"""Metrics files and TensorBoard: headers, resume of damaged files, flushing (mutation round BD)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.loggers import Logger, build_loggers
from lightlike.loggers.csv import CSVLogger, JSONLLogger, read_csv_metrics


def test_an_empty_metrics_csv_gets_its_header(tmp_path):
    """A metrics.csv left empty (a run killed right after creating it) is started with the header,
    so that its first row is not taken for one."""
    (tmp_path / "metrics.csv").write_text("")
    lg = CSVLogger(tmp_path)
    lg.log_metrics({"train/loss": 0.5}, 1)
    lg.finalize()
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "step,name,value"
    assert read_csv_metrics(tmp_path / "metrics.csv") == [(1, "train/loss", 0.5)]


def test_jsonl_resume_keeps_the_rows_after_a_blank_or_corrupt_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n\n{"step": 2, "a": 2.0}\nnot json\n{"step": 3, "a": 3.0}\n'
                    '{"step": 4, "a": 4.0}\n')
    lg = JSONLLogger(tmp_path)
    lg.resume(3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def _events_on_disk(log_dir):
    files = [f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents.")]
    assert len(files) == 1
    return os.path.getsize(os.path.join(log_dir, files[0]))


def test_tensorboard_hyperparams_reach_the_disk_at_once(tmp_path):
    pytest.importorskip("tensorboard")
    from lightlike.loggers.tensorboard import TensorBoardLogger

    lg = TensorBoardLogger(tmp_path, flush_secs=1e9)
    lg.log_hyperparams({"learning_rate": 0.1})
    assert _events_on_disk(tmp_path) > 0  # written through, not waiting in the file's buffer
    lg.finalize()


def test_tensorboard_flushes_once_flush_secs_have_passed(tmp_path):
    """flush_secs < 0: every write is older than flush_secs at once, so each reaches the disk."""
    pytest.importorskip("tensorboard")
    from lightlike.loggers.tensorboard import TensorBoardLogger

    lg = TensorBoardLogger(tmp_path, flush_secs=-1.0)
    lg.log_hyperparams({"learning_rate": 0.1})
    before = _events_on_disk(tmp_path)
    lg.log_metrics({"train/loss": 0.5}, 1)
    assert _events_on_disk(tmp_path) > before
    lg.finalize()


class Rec(Logger):
    def __init__(self):
        self.params, self.rows = None, []

    def log_metrics(self, metrics, step):
        self.rows.append(step)

    def log_hyperparams(self, params):
        self.params = dict(params)


def test_build_loggers_hands_the_hyperparams_to_every_logger(tmp_path):
    rec = Rec()
    assert build_loggers([rec], tmp_path, hyperparams={"learning_rate": 0.1}) == [rec]
    assert rec.params == {"learning_rate": 0.1}


def test_a_fit_logs_its_config_as_hyperparams(tmp_path):
    rec = Rec()
    ll.Fitter(loggers=[rec], max_steps=2, batch_size=4, output_dir=str(tmp_path / "run"), model_summary=False,
              learning_rate=0.03, log_level="error").fit(Classifier(), DictDataset(n=16))
    assert rec.params is not None and rec.params.get("learning_rate") == 0.03
    assert rec.rows == [2]

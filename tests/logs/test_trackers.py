"""Experiment trackers, driven by real fits and read back from what the libraries wrote: W&B's
offline run files (``.wandb``: a LevelDB-style log of protobuf records), MLflow's SQLite store
(through ``MlflowClient``), TensorBoard's event files (the hparams plugin's record). A resumed fit
must continue the tracker run its checkpoint names."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.errors import ConfigError

FIT = dict(batch_size=8, log_every=1, save_every=2, eval_every=2, model_summary=False, progress_bar=False)
ONE = dict(batch_size=8, log_every=1, save_strategy="no", model_summary=False, progress_bar=False)  # no checkpoint


def fit_and_resume(out: Path, loggers_1: list, loggers_2: list) -> tuple[ll.FitResult, ll.FitResult]:
    """A fit of 4 steps (checkpoints at 2 and 4), then the same run resumed to 6 steps."""
    train, val = DictDataset(32), DictDataset(16, seed=1)
    first = ll.Fitter(output_dir=str(out), max_steps=4, loggers=loggers_1, **FIT).fit(Classifier(), train, val)
    second = ll.Fitter(output_dir=str(out), max_steps=6, loggers=loggers_2, **FIT).fit(Classifier(), train, val,
                                                                                     resume=True)
    return first, second


def logged(result: ll.FitResult, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the loop's own record of what it logged."""
    return [(row["step"], row[key]) for row in result.state.log_history if key in row]


def saved_runs(checkpoint: Path) -> dict[str, str]:
    return json.loads((checkpoint / "trainer_state.json").read_text())["state"]["tracker_runs"]


# -- W&B ---------------------------------------------------------------------------------------
def wandb_records(run_dir: Path) -> list:
    """The records of a run's ``.wandb`` file: LevelDB's log format (blocks of 32 KiB, each record
    a 7-byte header: CRC-32, length, kind; FULL=1, FIRST=2, MIDDLE=3, LAST=4) after a 7-byte
    ``:W&B`` file header, each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the block's tail is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return records


def wandb_run(run_dir: Path) -> dict:
    """A run's id, config, history rows, summary and exit code, from its ``.wandb`` file."""
    out: dict = {"config": {}, "history": [], "summary": {}, "exit_code": None}
    for rec in wandb_records(run_dir):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["project"], out["tags"] = rec.run.run_id, rec.run.project, list(rec.run.tags)
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "history":
            out["history"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            out["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in rec.summary.update})
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out


@pytest.fixture(scope="module")
def wandb_fits(tmp_path_factory):
    pytest.importorskip("wandb")
    from lightlike.loggers import WandbLogger

    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "config"),
                            "WANDB_CACHE_DIR": str(root / "cache"), "WANDB_DATA_DIR": str(root / "data")}.items():
            mp.setenv(name, value)
        for name in ("WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_RESUME"):
            mp.delenv(name, raising=False)
        # W&B reads its environment once per process (wandb.setup): the first fit runs with WANDB_DIR
        # set, which the logger leaves in charge; the resumed one without, so its files go under
        # output_dir/logs (the logger passes dir=)
        mp.setenv("WANDB_DIR", str(root / "elsewhere"))
        (root / "elsewhere").mkdir()
        train, val = DictDataset(32), DictDataset(16, seed=1)
        r1 = ll.Fitter(output_dir=str(root / "out"), max_steps=4, **FIT,
                       loggers=["csv", WandbLogger(project="lightlike-test", tags=["a", "b"])]).fit(Classifier(), train, val)
        mp.delenv("WANDB_DIR")
        r2 = ll.Fitter(output_dir=str(root / "out"), max_steps=6, loggers=["wandb"], **FIT).fit(
            Classifier(), train, val, resume=True)
    return root, r1, r2


def test_wandb_run_holds_config_metrics_by_step_and_result(wandb_fits):
    root, r1, _ = wandb_fits
    [run_dir] = (root / "elsewhere" / "wandb").glob("offline-run-*")  # WANDB_DIR was respected
    run = wandb_run(run_dir)
    assert run["id"] == r1.state.tracker_runs["wandb"] == run_dir.name.rsplit("-", 1)[1]
    assert run["project"] == "lightlike-test" and run["tags"] == ["a", "b"]  # the instance's options
    config = ll.FitConfig(output_dir=str(root / "out"), max_steps=4, loggers=["csv", "WandbLogger"], **FIT).to_dict()
    assert {k: run["config"][k] for k in config} == json.loads(json.dumps(config))
    rows = run["history"]
    for key in ("train/loss", "train/lr", "val/loss", "val/accuracy"):
        assert [(row["train/global_step"], row[key]) for row in rows if key in row] == logged(r1, key)
    assert run["summary"]["result/global_step"] == 4
    assert run["summary"]["result/training_loss"] == r1.training_loss
    assert run["summary"]["result/val/loss"] == r1.metrics["val/loss"]
    assert run["exit_code"] == 0


def test_a_resumed_fit_continues_the_wandb_run_of_its_checkpoint(wandb_fits):
    root, r1, r2 = wandb_fits
    run_id = r1.state.tracker_runs["wandb"]
    assert saved_runs(root / "out" / "checkpoint-4") == {"wandb": run_id}
    [resumed_dir] = (root / "out" / "logs" / "wandb").glob("offline-run-*")  # no WANDB_DIR: under output_dir/logs
    resumed = wandb_run(resumed_dir)
    assert resumed["id"] == run_id == r2.state.tracker_runs["wandb"]
    assert resumed["config"]["max_steps"] == 6  # this fit's settings
    for key in ("train/loss", "val/loss"):  # steps 5 and 6, each once, in the same run
        assert [(row["train/global_step"], row[key]) for row in resumed["history"] if key in row] \
            == [(step, value) for step, value in logged(r2, key) if step > 4]
    assert resumed["summary"]["result/global_step"] == 6


# -- MLflow ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_fits(tmp_path_factory):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # the local SQLite store
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
            mp.delenv(name, raising=False)
        r1, r2 = fit_and_resume(root / "out", ["csv", "mlflow"], ["mlflow"])
    from mlflow.tracking import MlflowClient

    # no tracking URI given: the store is output_dir/logs/mlflow.db
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'out' / 'logs' / 'mlflow.db'}")
    return root, r1, r2, client


def test_mlflow_run_holds_params_metric_history_and_result(mlflow_fits):
    root, r1, r2, client = mlflow_fits
    [run] = client.search_runs(["0"])  # one run, in MLflow's Default experiment
    assert run.info.run_id == r1.state.tracker_runs["mlflow"] == r2.state.tracker_runs["mlflow"]
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["learning_rate"] == "0.001" and params["batch_size"] == "8" and params["seed"] == "0"
    assert params["loggers"] == '["csv", "mlflow"]' and params["max_grad_norm"] == "null"
    assert params["max_steps"] == "4"  # MLflow keeps a param as first logged (the resume warned)
    for key in ("train/loss", "train/lr", "val/loss", "val/accuracy"):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(history) == logged(r2, key)  # steps 1..6: the first fit's, then the resumed one's
    for r in (r1, r2):  # each fit's result at its last step
        result = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "result/training_loss")}
        assert result[r.global_step] == r.training_loss
    assert [m.value for m in client.get_metric_history(run.info.run_id, "result/global_step")] == [4, 6]
    assert saved_runs(root / "out" / "checkpoint-2") == {"mlflow": run.info.run_id}


def test_mlflow_options_and_a_failed_fit(mlflow_fits):
    """An instance with options writes where they say; a fit that raises ends its run FAILED,
    with what it logged before the error kept."""
    from lightlike.loggers import MLflowLogger

    root, _, _, client = mlflow_fits
    logger = MLflowLogger(tracking_uri=client.tracking_uri, experiment_name="options", run_name="tiny",
                          tags={"team": "x"})

    class Fails(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ll.Fitter(output_dir=str(root / "failing"), max_steps=4, loggers=[logger], callbacks=[Fails()], **ONE).fit(
            Classifier(), DictDataset(32))
    experiment = client.get_experiment_by_name("options")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny" and run.data.tags["team"] == "x" and run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
    assert "result/global_step" not in run.data.metrics  # no result: the fit did not return one


def test_a_run_that_cannot_be_closed_does_not_hide_the_fits_error(mlflow_fits, caplog):
    """The run deleted in the store (as by another user) and then the fit fails: closing the run
    fails too. The fit's own error is the one raised; a warning names the run."""
    from lightlike.loggers import MLflowLogger

    root, _, _, client = mlflow_fits

    class DeleteRunThenFail(ll.Callback):
        def on_fit_end(self, fitter, state, control):
            client.delete_run(state.tracker_runs["mlflow"])
            raise RuntimeError("the fit's own error")

    logger = MLflowLogger(tracking_uri=client.tracking_uri, experiment_name="unclosable")
    with caplog.at_level("WARNING", logger="lightlike"), pytest.raises(RuntimeError, match="the fit's own error"):
        ll.Fitter(output_dir=str(root / "unclosable"), max_steps=2, loggers=[logger], callbacks=[DeleteRunThenFail()],
                  **ONE).fit(Classifier(), DictDataset(32))
    [closing] = [r.getMessage() for r in caplog.records if "could not be closed" in r.getMessage()]
    assert closing.startswith("the mlflow run ") and "as failed: MlflowException" in closing


# -- TensorBoard's HPARAMS tab -----------------------------------------------------------------
def test_tensorboard_hparams_tab_holds_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import metadata

    fitter = ll.Fitter(output_dir=str(tmp_path), max_steps=2, loggers=["tensorboard"], **ONE)
    fitter.fit(Classifier(), DictDataset(32))
    values = {}
    for file in (tmp_path / "logs").glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(file)).Load():
            for v in event.summary.value:
                values.setdefault(v.tag, []).append(v)
    [start] = values[metadata.SESSION_START_INFO_TAG]  # in the run's own folder, next to its scalars
    assert start.metadata.plugin_data.plugin_name == metadata.PLUGIN_NAME
    hparams = metadata.parse_session_start_info_plugin_data(start.metadata.plugin_data.content).hparams
    assert hparams["learning_rate"].number_value == 0.001 and hparams["batch_size"].number_value == 8
    assert hparams["optimizer"].string_value == "adamw" and hparams["shuffle"].bool_value is True
    assert hparams["loggers"].string_value == '["tensorboard"]' and hparams["max_grad_norm"].string_value == "null"
    assert set(hparams) == set(ll.FitConfig(max_steps=2).to_dict())
    assert "config/text_summary" in values and "train/loss" in values  # the text table and the scalars stay


# -- what is refused ---------------------------------------------------------------------------
@pytest.mark.parametrize("library", ["wandb", "mlflow"])
def test_a_missing_library_names_the_extra(library, monkeypatch, tmp_path):
    from lightlike.loggers import build_loggers

    monkeypatch.setitem(sys.modules, library, None)  # `import library` fails as if not installed
    with pytest.raises(ConfigError, match=rf"needs the {library} package, which is not installed: "
                                          rf"pip install 'lightlike\[{library}\]'"):
        build_loggers([library], tmp_path)


def test_the_default_mlflow_store_without_sqlalchemy_names_the_extra(monkeypatch, tmp_path):
    """mlflow-skinny alone lacks what the default SQLite store needs: said at set-up, naming the
    store and the two ways out, instead of MLflow's ModuleNotFoundError at the first record."""
    pytest.importorskip("mlflow")
    from lightlike.loggers import build_loggers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError, match=r"default store, sqlite:///.*/logs/mlflow.db, needs sqlalchemy, which "
                                          r"mlflow-skinny does not install: pip install 'lightlike\[mlflow\]', or set "
                                          r"MLFLOW_TRACKING_URI"):
        build_loggers(["mlflow"], tmp_path, hyperparams={"a": 1})


def test_two_trackers_of_one_kind_are_refused(tmp_path):
    """A checkpoint keeps one run id per kind of tracker: two W&B loggers would both continue one run."""
    pytest.importorskip("wandb")
    from lightlike.loggers import WandbLogger, build_loggers

    with pytest.raises(ConfigError, match=r"loggers holds two wandb loggers; a checkpoint keeps one wandb run id"):
        build_loggers(["wandb", WandbLogger(project="other")], tmp_path)
    with pytest.raises(ConfigError, match="two wandb loggers"):  # on every rank alike
        build_loggers([WandbLogger(), WandbLogger(project="other")], tmp_path, enabled=False)

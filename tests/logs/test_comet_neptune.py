"""The Comet and Neptune loggers in their offline modes, driven by real fits and read back from what
the libraries wrote, with no network: Comet's offline zip (``experiment.json`` and the JSON lines
of ``messages.json``) and Neptune's offline operation log (``data-*.log``, one JSON operation a
line). A resumed fit continues the Comet experiment its checkpoint names; Neptune cannot continue
an offline run, so the resumed fit's run names the one it continues."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.errors import ConfigError

FIT = dict(batch_size=8, log_every=1, save_every=2, eval_every=2, model_summary=False, progress_bar=False)


def logged(result: ll.FitResult, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the loop's own record of what it logged."""
    return [(row["step"], row[key]) for row in result.state.log_history if key in row]


def saved_runs(checkpoint: Path) -> dict[str, str]:
    return json.loads((checkpoint / "trainer_state.json").read_text())["state"]["tracker_runs"]


class WithNaN(Classifier):
    """Its evaluation also reports ``val/nan``, NaN at every evaluation (the loop logs it as it is)."""

    def metrics(self, outputs, batch):
        return {**super().metrics(outputs, batch), "nan": outputs.sum() * math.nan}


class FailsAtStep3(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 3:
            raise RuntimeError("boom")


# -- Comet -------------------------------------------------------------------------------------
def comet_experiment(zip_path: Path) -> dict:
    """An offline experiment's key, project, tags, params, metrics (name -> [(step, value)]) and
    others, from its zip."""
    with zipfile.ZipFile(zip_path) as zf:
        meta = json.loads(zf.read("experiment.json"))
        lines = zf.read("messages.json").decode().splitlines()
    out: dict = {"key": meta["offline_id"], "project": meta["project_name"], "tags": meta["tags"],
                 "resume": meta["resume_strategy"], "params": {}, "metrics": {}, "others": {}}
    for line in lines:
        msg = json.loads(line)
        payload = msg["payload"]
        if msg["type"] == "parameter_msg":
            param = payload.get("param") or payload["params"]
            if param["source"] == "manual":
                out["params"][param["paramName"]] = param["paramValue"]
        elif msg["type"] == "metric_msg":
            m = payload["metric"]
            value = float(m["metricValue"])  # NaN is written as the string "NaN"
            out["metrics"].setdefault(m["metricName"], []).append((m["step"], value))
        elif msg["type"] == "log_other":
            out["others"][payload["key"]] = payload["value"]
    return out


@pytest.fixture(scope="module")
def comet_fits(tmp_path_factory):
    pytest.importorskip("comet_ml")
    from lightlike.loggers import CometLogger

    root = tmp_path_factory.mktemp("comet")
    train, val = DictDataset(32), DictDataset(16, seed=1)
    quiet = dict(display_summary_level=0, auto_output_logging=False, log_env_details=False, log_git_metadata=False,
                 log_git_patch=False, log_code=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMET_CONFIG", str(root / "no-config"))  # no ~/.comet.config of the machine
        for name in ("COMET_API_KEY", "COMET_OFFLINE_DIRECTORY", "COMET_EXPERIMENT_KEY", "COMET_PROJECT_NAME"):
            mp.delenv(name, raising=False)
        logger = CometLogger(project_name="lightlike-test", name="tiny", tags=["a", "b"], online=False, **quiet)
        r1 = ll.Fitter(output_dir=str(root / "out"), max_steps=4, loggers=["csv", logger],
                       **FIT).fit(WithNaN(), train, val)
        mp.setenv("COMET_START_ONLINE", "false")  # the name in loggers: Comet's own setting says offline
        mp.setenv("COMET_AUTO_LOG_OUTPUT_LOGGING", "false")
        r2 = ll.Fitter(output_dir=str(root / "out"), max_steps=6, loggers=["comet_ml"], **FIT).fit(
            Classifier(), train, val, resume=True)
    zips = sorted((root / "out" / "logs" / "comet").glob("*.zip"), key=lambda p: len(p.name))
    return root, r1, r2, [comet_experiment(z) for z in zips]


def test_comet_experiment_holds_params_metrics_by_step_and_result(comet_fits):
    root, r1, _, [first, _] = comet_fits
    assert first["key"] == r1.state.tracker_runs["comet"] and first["resume"] == "create"
    assert first["project"] == "lightlike-test" and sorted(first["tags"]) == ["a", "b"]
    assert first["others"]["Name"] == "tiny" and first["others"]["lightlike_status"] == "finished"
    params = first["params"]
    assert params["learning_rate"] == 0.001 and params["batch_size"] == 8 and params["optimizer"] == "adamw"
    assert params["loggers"] == '["csv", "CometLogger"]' and params["max_grad_norm"] == "null"
    for key in ("train/loss", "train/lr", "val/loss", "val/accuracy"):
        assert first["metrics"][key] == logged(r1, key)
    nans = first["metrics"]["val/nan"]
    assert [s for s, _ in nans] == [2, 4] and all(math.isnan(v) for _, v in nans)  # NaN kept, at its steps
    assert first["metrics"]["result/global_step"] == [(4, 4.0)]
    assert first["metrics"]["result/training_loss"] == [(4, r1.training_loss)]
    assert first["metrics"]["result/val/loss"] == [(4, r1.metrics["val/loss"])]


def test_a_resumed_fit_continues_the_comet_experiment_of_its_checkpoint(comet_fits):
    root, r1, r2, [_, resumed] = comet_fits
    key = r1.state.tracker_runs["comet"]
    assert saved_runs(root / "out" / "checkpoint-4") == {"comet": key}
    assert resumed["key"] == key == r2.state.tracker_runs["comet"] and resumed["resume"] == "get"
    assert resumed["params"]["max_steps"] == 6  # this fit's settings
    for key in ("train/loss", "val/loss"):  # steps 5 and 6, in the same experiment
        assert resumed["metrics"][key] == [(step, value) for step, value in logged(r2, key) if step > 4]
    assert resumed["metrics"]["result/global_step"] == [(6, 6.0)]
    assert resumed["others"]["lightlike_status"] == "finished"


def test_a_failed_fit_marks_the_comet_experiment_failed(tmp_path, monkeypatch):
    """A fit that raises ends its experiment with ``lightlike_status`` ``failed``, what it logged
    before the error kept, and no result. (``experiment_key=`` and ``project=``, Lightning's
    names, say which experiment.)"""
    pytest.importorskip("comet_ml")
    from lightlike.loggers import CometLogger

    monkeypatch.setenv("COMET_CONFIG", str(tmp_path / "no-config"))
    monkeypatch.delenv("COMET_OFFLINE_DIRECTORY", raising=False)
    logger = CometLogger(online=False, experiment_key="0123456789abcdef" * 2, project="failing", display_summary_level=0, auto_output_logging=False, log_env_details=False,
                         log_git_metadata=False, log_git_patch=False, log_code=False)
    with pytest.raises(RuntimeError, match="boom"):
        ll.Fitter(output_dir=str(tmp_path), max_steps=4, loggers=[logger], callbacks=[FailsAtStep3()],
                  save_strategy="no", batch_size=8, log_every=1, model_summary=False, progress_bar=False).fit(
            Classifier(), DictDataset(32))
    [zip_path] = (tmp_path / "logs" / "comet").glob("*.zip")
    experiment = comet_experiment(zip_path)
    assert experiment["others"]["lightlike_status"] == "failed"
    assert experiment["key"] == "0123456789abcdef" * 2 and experiment["project"] == "failing"
    assert [s for s, _ in experiment["metrics"]["train/loss"]] == [1, 2]
    assert not any(k.startswith("result/") for k in experiment["metrics"])


# -- Neptune -----------------------------------------------------------------------------------
def neptune_run(run_dir: Path) -> dict:
    """An offline run's id, fields (path -> value) and series (path -> [(step, value)]), from its
    operation log."""
    out: dict = {"id": json.loads((run_dir / "metadata.json").read_text())["containerId"], "fields": {},
                 "series": {}, "tags": []}
    for log_file in sorted(run_dir.glob("data-*.log")):
        for line in log_file.read_text().splitlines():
            op = json.loads(line)["obj"]
            path = "/".join(op["path"])
            if op["type"].startswith("Assign"):
                out["fields"][path] = op["value"]
            elif op["type"] in ("LogFloats", "LogStrings"):
                out["series"].setdefault(path, []).extend((v["step"], v["value"]) for v in op["values"])
            elif op["type"] == "AddStrings" and path == "sys/tags":
                out["tags"] += op["values"]
    return out


@pytest.fixture(scope="module")
def neptune_fits(tmp_path_factory):
    pytest.importorskip("neptune")
    from lightlike.loggers import NeptuneLogger

    root = tmp_path_factory.mktemp("neptune")
    train, val = DictDataset(32), DictDataset(16, seed=1)
    quiet = dict(capture_stdout=False, capture_stderr=False, capture_hardware_metrics=False, git_ref=False,
                 source_files=[])
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightlike").addHandler(handler)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("NEPTUNE_DATA_DIRECTORY", "NEPTUNE_MODE", "NEPTUNE_CUSTOM_RUN_ID", "NEPTUNE_PROJECT"):
            mp.delenv(name, raising=False)
        logger = NeptuneLogger(project="ws/lightlike-test", name="tiny", tags=["a", "b"], mode="offline", **quiet)
        r1 = ll.Fitter(output_dir=str(root / "out"), max_steps=4, loggers=["csv", logger],
                       **FIT).fit(WithNaN(), train, val)
        mp.setenv("NEPTUNE_MODE", "offline")  # the name in loggers: Neptune's own setting says offline
        r2 = ll.Fitter(output_dir=str(root / "out"), max_steps=6, loggers=["neptune"], **FIT).fit(
            Classifier(), train, val, resume=True)
        logging.getLogger("lightlike").removeHandler(handler)
        assert "NEPTUNE_DATA_DIRECTORY" not in os.environ  # set while the run started, then restored
    runs = {run["id"]: run for run in map(neptune_run, (root / "out" / "logs" / "neptune" / "offline").iterdir())}
    return root, r1, r2, runs, warnings


def test_neptune_run_holds_config_series_by_step_and_result(neptune_fits):
    root, r1, _, runs, warnings = neptune_fits
    run = runs[r1.state.tracker_runs["neptune"]]
    assert run["fields"]["sys/name"] == "tiny" and sorted(run["tags"]) == ["a", "b"]
    fields = run["fields"]
    assert fields["config/learning_rate"] == 0.001 and fields["config/batch_size"] == 8
    assert fields["config/loggers"] == '["csv", "NeptuneLogger"]' and fields["config/max_grad_norm"] == "null"
    for key in ("train/loss", "train/lr", "val/loss", "val/accuracy"):
        assert run["series"][key] == logged(r1, key)
    assert "val/nan" not in run["series"]  # Neptune's float series drops NaN...
    assert run["series"]["nonfinite/val/nan"] == [(2, "nan"), (4, "nan")]  # ...so it is kept as text, at its steps
    [warning] = [w for w in warnings if "Neptune cannot hold" in w]
    assert "val/nan at step 2" in warning and "recorded as text in nonfinite/val/nan" in warning
    assert fields["result/global_step"] == 4 and fields["result/training_loss"] == r1.training_loss
    assert fields["result/val/loss"] == r1.metrics["val/loss"]
    assert fields["sys/failed"] is False


def test_a_resumed_offline_neptune_fit_names_the_run_it_continues(neptune_fits):
    root, r1, r2, runs, warnings = neptune_fits
    first = r1.state.tracker_runs["neptune"]
    assert saved_runs(root / "out" / "checkpoint-4") == {"neptune": first}
    resumed = runs[r2.state.tracker_runs["neptune"]]
    assert resumed["id"] != first and resumed["fields"]["lightlike/resumed_from"] == first
    assert resumed["fields"]["config/max_steps"] == 6
    for key in ("train/loss", "val/loss"):
        assert resumed["series"][key] == [(step, value) for step, value in logged(r2, key) if step > 4]
    assert set(runs) == {first, resumed["id"]}


def test_a_failed_fit_marks_the_neptune_run_failed(tmp_path, monkeypatch):
    pytest.importorskip("neptune")
    from lightlike.loggers import NeptuneLogger

    monkeypatch.delenv("NEPTUNE_DATA_DIRECTORY", raising=False)

    logger = NeptuneLogger(mode="offline", capture_stdout=False, capture_stderr=False, capture_hardware_metrics=False,
                           git_ref=False, source_files=[])
    with pytest.raises(RuntimeError, match="boom"):
        ll.Fitter(output_dir=str(tmp_path), max_steps=4, loggers=[logger], callbacks=[FailsAtStep3()], save_strategy="no",
                  batch_size=8, log_every=1, model_summary=False, progress_bar=False).fit(Classifier(), DictDataset(32))
    [run_dir] = (tmp_path / "logs" / "neptune" / "offline").iterdir()
    run = neptune_run(run_dir)
    assert run["fields"]["sys/failed"] is True and [s for s, _ in run["series"]["train/loss"]] == [1, 2]
    assert not any(k.startswith("result/") for k in run["fields"])


# -- names and what is refused -----------------------------------------------------------------
@pytest.mark.parametrize("library,extra,names", [("comet_ml", "comet", ["comet", "comet_ml"]),
                                                 ("neptune", "neptune", ["neptune"])])
def test_a_missing_library_names_the_extra(library, extra, names, monkeypatch, tmp_path):
    from lightlike.loggers import build_loggers

    monkeypatch.setitem(sys.modules, library, None)  # `import library` fails as if not installed
    for name in names:
        with pytest.raises(ConfigError, match=rf"needs the {library} package, which is not installed: "
                                              rf"pip install 'lightlike\[{extra}\]'"):
            build_loggers([name], tmp_path)


def test_comet_and_comet_ml_are_one_logger(tmp_path):
    from lightlike.loggers import build_loggers

    with pytest.raises(ConfigError, match="logger 'comet' is listed twice"):
        build_loggers(["comet", "comet_ml"], tmp_path, enabled=False)
    with pytest.raises(ConfigError, match=r"unknown logger 'neptun' \(did you mean 'neptune'\?\)"):
        build_loggers(["neptun"], tmp_path, enabled=False)

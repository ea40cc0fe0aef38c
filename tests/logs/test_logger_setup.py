"""BF mutation round: build_loggers spec checks on every rank, names, and resume at step 0."""
from __future__ import annotations

import pytest

from lightlike.errors import ConfigError
from lightlike.loggers import CSVLogger, build_loggers
from lightlike.loggers.csv import read_csv_metrics


@pytest.mark.parametrize("spec, match", [
    (["cvs"], r"unknown logger 'cvs' \(did you mean 'csv'\?\)"),
    (["csv", "csv"], "logger 'csv' is listed twice"),
    ({"csv": 1}, r"loggers must be 'auto', a list of names .* got \{'csv': 1\}"),
    ([3], "loggers entries must be names .* got int"),
])
def test_an_invalid_spec_fails_on_other_ranks_too(tmp_path, spec, match):
    with pytest.raises(ConfigError, match=match):
        build_loggers(spec, tmp_path, enabled=False)
    assert not (tmp_path / "logs").exists()


def test_logger_names_are_case_and_space_insensitive(tmp_path):
    loggers = build_loggers([" CSV ", "JsonL"], tmp_path)
    assert [type(lg).__name__ for lg in loggers] == ["CSVLogger", "JSONLLogger"]
    with pytest.raises(ConfigError, match="listed twice"):
        build_loggers(["csv", "CSV"], tmp_path)


def test_a_dict_is_not_a_list_of_names(tmp_path):
    with pytest.raises(ConfigError, match="loggers must be"):
        build_loggers({"csv": True}, tmp_path)


def test_resume_at_step_zero_drops_every_later_row(tmp_path):
    lg = CSVLogger(tmp_path / "logs")
    lg.log_metrics({"train/loss": 1.0}, 1)
    lg.log_metrics({"train/loss": 0.5}, 2)
    lg.finalize() if hasattr(lg, "finalize") else None
    build_loggers(["csv"], tmp_path, resume_step=0)
    assert read_csv_metrics(tmp_path / "logs" / "metrics.csv") == []

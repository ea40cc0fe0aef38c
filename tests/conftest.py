import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="more cases in the kill matrix and other long parametrisations")


@pytest.fixture(autouse=True)
def lightlike_logger_as_found():
    """Each test finds the ``lightlike`` logger as the one before found it: a fit sets its level
    (``log_level``) and handler for the whole process, so a test after one with
    ``log_level="error"`` saw no warning in ``caplog``, and passed or failed by the order tests ran."""
    logger = logging.getLogger("lightlike")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(nproc, *args, script=...)``: the output folder of a finished run of a test
    script (``scripts/ddp_target.py`` unless named), launched once per session however many tests
    compare against it (reference runs: same script, same arguments, same result). Tests only read
    it: anything that writes (a resume, an export) goes to the test's own folder."""
    from test_ddp import SCRIPT, launch

    base = tmp_path_factory.mktemp("shared-runs")
    done: dict[tuple, Path] = {}

    def get(nproc: int, *args: str, script: Path = SCRIPT) -> Path:
        key = (str(script), nproc, *args)
        if key not in done:
            out = base / f"run-{len(done)}"
            p = launch(nproc, out, *args, script=script)
            assert p.returncode == 0, p.stderr[-4000:]
            done[key] = out
        return done[key]

    return get

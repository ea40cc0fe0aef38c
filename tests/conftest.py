import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs on the CPU, as CI does (gloo, CPU references, several ranks on one machine), on a
# machine with a GPU too: there it failed where a test compares with a CPU tensor or starts two
# ranks for one GPU. tests/gpu/test_cuda.py holds the GPU's own tests; LIGHTLIKE_TEST_GPU=1 leaves the
# GPU visible to them (and to the whole suite, a probe of what differs on a GPU: read what fails).
# Set before anything initialises CUDA; the processes the tests start inherit it.
if os.environ.get("LIGHTLIKE_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Each test worker (pytest-xdist) compiles into an inductor cache of its own: two workers
# compiling the same kernel into the one shared /tmp/torchinductor_<user> raced, and one loaded
# the other's half-written library ("ImportError: ... main.so: file too short"). The processes
# a test starts inherit it.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_lightlike_{_worker}")


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


def _process_state() -> dict[str, object]:
    """Process-wide settings a fit, an evaluation or a prediction might change and must leave as
    it found them (signal handlers, torch's global switches, the environment). Left out: what
    torch itself sets for good (its DataLoader's SIGCHLD handler, the excepthook of
    ``init_process_group``, the inductor's cache variables) and ``import deepspeed``."""
    signals = [s for s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP") if hasattr(signal, s)]
    return {
        **{f"handler of {s}": signal.getsignal(getattr(signal, s)) for s in signals},
        "torch default dtype": torch.get_default_dtype(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch inference mode": torch.is_inference_mode_enabled(),
        "torch anomaly mode": torch.is_anomaly_enabled(),
        "torch deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                           torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn deterministic/benchmark": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "torch threads": torch.get_num_threads(),
        "cpu autocast": torch.is_autocast_enabled("cpu"),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "os.environ": {k: v for k, v in os.environ.items()
                       if k not in ("PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK")
                       and not k.lstrip("_").startswith("TORCHINDUCTOR_")},
    }


@pytest.fixture(autouse=True)
def process_state_as_found():
    """Every test leaves the process as it found it (set up before, so it checks after every
    other fixture, monkeypatch included, has undone its changes): a fit that left a signal handler,
    torch's default dtype or deterministic mode behind would change every later fit in a notebook.
    A change fails the test that made it, naming what changed, and is undone for the next one."""
    before = _process_state()
    yield
    after = _process_state()
    changed = sorted(k for k in before if before[k] != after[k])
    if not changed:
        return
    detail = []
    for key in changed:
        if key == "os.environ":
            was, now = before[key], after[key]
            diff = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))  # type: ignore[union-attr]
            detail.append(f"os.environ: {', '.join(f'{k}: {was.get(k)!r} -> {now.get(k)!r}' for k in diff)}")  # type: ignore[union-attr]
            for k in diff:
                if k in was:  # type: ignore[operator]
                    os.environ[k] = was[k]  # type: ignore[index]
                else:
                    os.environ.pop(k, None)
        else:
            detail.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    for sig in [k for k in changed if k.startswith("handler of ")]:
        signal.signal(getattr(signal, sig.removeprefix("handler of ")), before[sig])  # type: ignore[arg-type]
    torch.set_default_dtype(before["torch default dtype"])  # type: ignore[arg-type]
    torch.set_grad_enabled(before["torch grad mode"])  # type: ignore[arg-type]
    torch.set_anomaly_enabled(before["torch anomaly mode"])  # type: ignore[arg-type]
    det, warn = before["torch deterministic algorithms"]  # type: ignore[misc]
    torch.use_deterministic_algorithms(det, warn_only=warn)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before["cudnn deterministic/benchmark"]  # type: ignore[misc]
    torch.set_num_threads(before["torch threads"])  # type: ignore[arg-type]
    torch.set_float32_matmul_precision(before["float32 matmul precision"])  # type: ignore[arg-type]
    pytest.fail("the test left process-wide state changed: " + "; ".join(detail), pytrace=False)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(nproc, *args, script=...)``: the output folder of a finished run of a test
    script (``scripts/ddp_target.py`` unless named), launched once per session however many tests
    compare against it (reference runs: same script, same arguments, same result). Tests only read
    it: anything that writes (a resume, an export) goes to the test's own folder."""
    from launching import DDP_TARGET, launch, launch_each

    base = tmp_path_factory.mktemp("shared-runs")
    done: dict[tuple, Path] = {}

    def get(nproc: int, *args: str, script: Path = DDP_TARGET) -> Path:
        key = (str(script), nproc, *args)
        if key not in done:
            out = base / f"run-{len(done)}"
            p = launch(nproc, out, *args, script=script)
            assert p.returncode == 0, p.stderr[-4000:]
            done[key] = out
        return done[key]

    def each(nproc: int, *arg_lists: list[str], script: Path = DDP_TARGET) -> list[Path]:
        """``get`` for several runs, those not run yet launched together (``launch_each``: one
        process group, one run after another), so one launch pays for all of them."""
        keys = [(str(script), nproc, *args) for args in arg_lists]
        todo = [k for k in dict.fromkeys(keys) if k not in done]
        if todo:
            outs = [base / f"run-{len(done) + i}" for i in range(len(todo))]
            p = launch_each(nproc, [(out, list(k[2:])) for out, k in zip(outs, todo, strict=True)], script=script)
            assert p.returncode == 0, p.stderr[-4000:]
            done.update(zip(todo, outs, strict=True))
        return [done[k] for k in keys]

    get.each = each  # type: ignore[attr-defined]
    return get

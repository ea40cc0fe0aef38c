"""The real TensorBoard server, on loopback, serves the scalars a run logged: the numbers read
back through its HTTP data API are the numbers in the run's metrics.jsonl (TensorBoard stores
float32), step for step, including after a resume."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset

import lightlike as ll

pytest.importorskip("tensorboard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(base: str, path: str, **query: str):
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Crash(ll.Callback):
    """Ends the first run at step 6's log row, after it was written: its last checkpoint is 4."""

    def on_log(self, fitter, state, control, metrics):
        if state.global_step == 6:
            raise RuntimeError("killed")


def fit(out: Path, steps: int, resume: bool = False, callbacks=()) -> None:
    torch.manual_seed(0)
    ll.Fitter(max_steps=steps, batch_size=8, log_every=2, save_every=4, eval_every=4, output_dir=str(out),
              loggers=["tensorboard", "jsonl"], log_level="warning", overwrite_output_dir=not resume,
              callbacks=list(callbacks)).fit(Classifier(), DictDataset(n=64), DictDataset(n=16, seed=1),
                                             resume=resume or None)


def test_server_serves_the_logged_scalars(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed"):
        fit(out, 10, callbacks=[Crash()])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    fit(out, 10, resume=True)  # resumes from checkpoint-4: steps 5-6 are logged again, and served once
    logged: dict[str, dict[int, float]] = {}
    for line in (out / "logs" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k, v in row.items():
            if k not in ("step", "epoch", "time"):
                logged.setdefault(k, {})[row["step"]] = v  # a resumed step replaces the earlier row
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out / "logs"),
                               "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false",
                               "--reload_interval", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, tags = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            try:
                tags = get_json(base, "/data/plugin/scalars/tags")
                if tags and all(t in next(iter(tags.values())) for t in ("train/loss", "val/loss")):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert tags, "the TensorBoard server did not come up or served no scalars"
        (run,) = tags  # one run: the logs directory
        for tag in ("train/loss", "val/loss", "val/accuracy", "train/lr"):
            points = get_json(base, "/data/plugin/scalars/scalars", run=run, tag=tag)
            served = {int(step): value for _, step, value in points}
            assert [int(step) for _, step, _ in points] == sorted(logged[tag]), tag  # every step once, none missing
            for step, value in logged[tag].items():
                assert served[step] == pytest.approx(value, rel=1e-6), (tag, step)
    finally:
        server.terminate()
        server.wait(timeout=10)

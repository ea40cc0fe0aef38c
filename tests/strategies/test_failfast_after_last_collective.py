"""A failure on one rank after a call's last collective (in ``on_evaluate`` of a fit's last
evaluation, in ``compute_metrics`` of ``validate()``) still ends every rank: no rank returns
normally from fit()/validate() into the code after it, and rank 0's line names rank 1 and its
error.

This file is also the torchrun target of its tests: ``python THIS_FILE OUT MODE``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import Classifier, DictDataset  # noqa: E402
from launching import launch  # noqa: E402

import lightlike as ll  # noqa: E402

QUIET = dict(loggers=[], progress_bar=False, model_summary=False)


class FailInLastEvaluation(ll.Callback):
    def on_evaluate(self, fitter, state, control, metrics):
        if fitter.strategy.global_rank == 1 and state.global_step == state.max_steps:
            raise ValueError("injected failure in on_evaluate on rank 1")


class FailingComputeMetrics(Classifier):
    def compute_metrics(self, predictions, labels):
        if int(os.environ.get("RANK", "0")) == 1:
            raise ValueError("injected failure in compute_metrics on rank 1")
        return {"acc": float((predictions.argmax(-1) == labels).float().mean())}


def _target(out: Path, mode: str) -> None:
    """Run by torchrun: rank 1 fails where ``mode`` says; a rank whose call returns writes a marker."""
    rank = int(os.environ.get("RANK", "0"))
    if mode == "fit":  # the last evaluation of the fit, no save after it
        ll.Fitter(max_steps=2, eval_every=2, batch_size=4, output_dir=str(out / "fit"),
                  callbacks=[FailInLastEvaluation()], **QUIET).fit(Classifier(), DictDataset(16), DictDataset(6))
    else:
        ll.Fitter(max_steps=1, eval_batch_size=3, output_dir=str(out / "validate"), **QUIET).validate(
            FailingComputeMetrics(), DictDataset(6))
    (out / f"{mode}-returned-rank{rank}").write_text(f"{mode}() returned normally")


@pytest.mark.parametrize("mode,where", [("fit", "on_evaluate"), ("validate", "compute_metrics")])
def test_a_failure_after_the_last_collective_ends_every_rank(tmp_path, mode, where):
    """Rank 1 failed in ``where`` past the call's last collective: rank 0 had no collective left,
    returned normally and ran the caller's code (an export, a push) until torchrun ended it."""
    start = time.monotonic()
    p = launch(2, tmp_path, mode, script=Path(__file__).resolve(), timeout=120)
    elapsed = time.monotonic() - start
    assert p.returncode != 0
    assert f"rank 1 of 2 failed during evaluation at step {2 if mode == 'fit' else 0}: ValueError: injected " \
           f"failure in {where} on rank 1" in p.stderr, p.stderr[-3000:]
    # rank 0's own line names rank 1 and its error (read from the process group's store)
    step = 2 if mode == 'fit' else 0
    assert re.search(rf"rank 0 of 2 stopped during [a-z ]+ at step {step}: rank 1 of 2 failed during evaluation "
                     rf"at step {step}: ValueError: injected failure in {where} on rank 1 \(here: RuntimeError",
                     p.stderr), p.stderr[-3000:]
    assert "lightlike: rank 1 of 2 failed during evaluation" in p.stderr  # a note on rank 0's traceback
    assert not list(tmp_path.glob(f"{mode}-returned-rank*")), "a rank's call returned although rank 1 failed"
    assert elapsed < 60, f"took {elapsed:.0f}s"  # a generous bound on a hang, not a speed claim


if __name__ == "__main__":
    torch.manual_seed(0)
    _target(Path(sys.argv[1]), sys.argv[2])

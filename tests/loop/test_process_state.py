"""What a fit, an evaluation or a prediction leaves behind in the process: the application's
signal handlers, its logging, its random streams, and no process groups piling up over fits (a
notebook, ``Fitter.search``'s trials, a script that fits twice). ``conftest.py`` checks torch's
global switches and the environment after every test; these are the cases it cannot see."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import Classifier, DictDataset
from launching import launch
from torch.utils.data import DataLoader

import lightlike as ll

QUIET = dict(model_summary=False, loggers=[], log_level="error")


@pytest.mark.parametrize("signals", [["SIGTERM", "TERM"], ["SIGUSR1", "SIGUSR1"]])
def test_a_signal_named_twice_gets_the_applications_handler_back(tmp_path, signals):
    """``preemption_signals=["SIGTERM", "TERM"]`` installed lightlike's handler twice, the second
    time recording its own as the one to restore: after fit the process ignored SIGTERM for good."""
    sig = signal.SIGTERM if "TERM" in signals[0] else signal.SIGUSR1
    def mine(signum, frame):  # the application's own handler
        pass
    before = signal.signal(sig, mine)
    try:
        ll.Fitter(output_dir=str(tmp_path), max_steps=2, preemption_signals=signals, **QUIET).fit(
            Classifier(), DictDataset(16))
        assert signal.getsignal(sig) is mine
    finally:
        signal.signal(sig, before)


def test_logging_configured_between_two_fits_prints_each_line_once(tmp_path, capsys):
    """fit, then ``logging.basicConfig`` (a notebook), then fit again with the same Fitter: the
    application's handler prints lightlike's lines and lightlike's own handler no longer does."""
    root, ours = logging.getLogger(), logging.getLogger("lightlike")
    saved = list(root.handlers), root.level
    root.handlers[:] = []  # an application that has not configured logging (pytest's handlers off)
    try:
        fitter = ll.Fitter(output_dir=str(tmp_path), max_steps=2, log_every=1, model_summary=False, loggers=[],
                           overwrite_output_dir=True, progress_bar=False)
        fitter.fit(Classifier(), DictDataset(16))
        assert capsys.readouterr().err.count("step 1/2") == 1  # lightlike's handler prints it
        handler = logging.StreamHandler(sys.stderr)  # logging.basicConfig(level=INFO, format="APP ...")
        handler.setFormatter(logging.Formatter("APP %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        fitter.fit(Classifier(), DictDataset(16))
        err = capsys.readouterr().err
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert err.count("step 1/2") == 1, err
    assert "APP step 1/2" in err
    assert ours.handlers, "lightlike's handler stays for a later fit without the application's"


@pytest.mark.parametrize("call", ["validate", "test", "predict"])
def test_evaluation_outside_fit_leaves_the_global_random_streams_alone(tmp_path, call):
    """A DataLoader of the user's draws its base seed from the global generator when an iterator
    starts; inside fit evaluation keeps the streams, and now validate/test/predict do too."""
    fitter = ll.Fitter(output_dir=str(tmp_path), **QUIET)  # constructing it seeds
    module, loader = Classifier(), DataLoader(DictDataset(12, seed=1), batch_size=4)
    torch.manual_seed(123)
    getattr(fitter, call)(module, loader)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3)), f"{call}() drew from the global torch generator"


def test_constructing_a_fitter_seeds_as_the_hf_trainer_does_so_a_module_built_after_it_repeats():
    """A deliberate difference from Lightning (docs/migrating.md): ``Fitter(seed=s)`` seeds the
    global generators when built, as ``transformers.Trainer(args)`` does, so ``Fitter(seed=0).fit(
    Model(), ...)`` starts from the same weights every run; Lightning's ``Trainer()`` seeds nothing
    (its users call ``seed_everything`` first, which is unchanged here)."""
    def built_after(seed):
        torch.manual_seed(12345)  # whatever the process drew before
        ll.Fitter(seed=seed, **QUIET)
        return Classifier().state_dict()

    a, b, other = built_after(0), built_after(0), built_after(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], other[k]) for k in a)
    torch.manual_seed(0)
    assert all(torch.equal(a[k], v) for k, v in Classifier().state_dict().items()), "seeded as torch.manual_seed(0)"


def _held():
    return len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/fd"))


def test_fsdp_fits_in_one_process_reuse_their_checkpoint_group(tmp_path):
    """Each FSDP Fitter with async_save made a new gloo group: +1 group and +4 open files per fit,
    for as long as the process group lives (hsdp's 2-D mesh too: on two processes, below)."""
    held = []
    for j in range(3):
        ll.Fitter(output_dir=str(tmp_path / str(j)), max_steps=2, batch_size=4, strategy="fsdp", async_save=True,
                  save_every=2, **QUIET).fit(Classifier(), DictDataset(16))
        held.append(_held())
    assert held[2] == held[1] == held[0], f"(process groups, open files) after each fit: {held}"


def test_fsdp_fits_on_two_processes_reuse_their_meshes_and_groups(tmp_path):
    """Two ranks, four fits alternating async_save and hsdp: after the first two, nothing more is held."""
    p = launch(2, tmp_path, script=Path(__file__).parents[1] / "scripts" / "fsdp_fits_in_a_row.py")
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        rows = [tuple(map(int, m)) for m in re.findall(rf"HELD rank={rank} fit=(\d) groups=(\d+) fds=(\d+)", p.stdout)]
        assert [r[0] for r in rows] == [0, 1, 2, 3], p.stdout
        assert rows[2][1:] == rows[3][1:] == rows[1][1:], f"rank {rank}: (fit, groups, open files) {rows}"

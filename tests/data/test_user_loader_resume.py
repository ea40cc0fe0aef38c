"""A fit on the user's own DataLoader is killed mid-epoch and resumed: it ends with the
uninterrupted run's weights and metrics log, bit for bit (tests/scripts/user_loader_target.py).
A RandomSampler, SequentialSampler or DistributedSampler is replaced by lightlike's sampler of the
same meaning, which seeks (a DistributedSampler that pads is kept, and read again); a WeightedRandomSampler cannot seek and its epoch is read again up to
the checkpoint; one drawing from a generator of its own is said at set-up to resume only from an
epoch's end, and such a resume is refused before anything is restored."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, WeightedRandomSampler

from lightlike.data.loading import build_train_data
from lightlike.data.sampler import ResumableSampler

SCRIPT = Path(__file__).parents[1] / "scripts" / "user_loader_target.py"
_REFERENCE: dict = {}


def run(out, loader, workers=0, kill_after=0):
    cmd = [sys.executable, str(SCRIPT), str(out), "--loader", loader, "--workers", str(workers)]
    if kill_after:
        cmd += ["--kill-after", str(kill_after)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, start_new_session=True)


def outcome(out):
    metrics = [json.loads(line) for line in (Path(out) / "logs" / "metrics.jsonl").read_text().splitlines()]
    return (Path(out) / "final.safetensors").read_bytes(), [m for m in metrics if "train/loss" in m]


@pytest.mark.parametrize(("loader", "workers"), [("shuffle", 0), ("shuffle", 2), ("sequential", 0),
                                                 ("distributed", 0), ("weighted", 0)])
def test_killed_mid_epoch_resumes_bit_identical(tmp_path, loader, workers):
    ref = tmp_path / "ref"
    assert run(ref, loader, workers).returncode == 0
    cut = tmp_path / "cut"
    killed = run(cut, loader, workers, kill_after=5)
    assert killed.returncode == -signal.SIGKILL and "kill fired after step 5" in killed.stdout, killed.stderr
    resumed = run(cut, loader, workers)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "16 samples into it" in resumed.stderr
    reads_again = "reading the 4 batch(es) this process had taken of epoch 0 again" in resumed.stderr
    assert reads_again == (loader == "weighted")
    weights, metrics = outcome(cut)
    ref_weights, ref_metrics = outcome(ref)
    assert [m["step"] for m in metrics] == list(range(1, 15))  # every step once
    assert metrics == ref_metrics
    assert weights == ref_weights


def test_a_sampler_with_its_own_generator_is_said_at_set_up_and_refused_at_resume(tmp_path):
    out = tmp_path / "run"
    killed = run(out, "own_generator", kill_after=5)
    said = "this fit cannot resume mid-epoch: the training DataLoader's WeightedRandomSampler draws its order"
    assert killed.returncode == -signal.SIGKILL and said in killed.stderr
    assert killed.stderr.index(said) < killed.stderr.index("step")  # before step 1 is logged
    resumed = run(out, "own_generator")
    assert resumed.returncode == 1 and "DataError: cannot resume mid-epoch" in resumed.stderr
    assert "resumed from" not in resumed.stderr  # refused before anything is restored


def test_the_rebuilt_loader_keeps_the_users_settings_and_meaning(caplog):
    """A RandomSampler becomes a shuffling ResumableSampler (seed: the Fitter's), a DistributedSampler
    one with its own seed and rank (the same order where it does not pad); batch_size, drop_last and
    collate_fn are kept; a WeightedRandomSampler is kept as it is."""
    data = torch.arange(24.0)
    collate = lambda items: ("mine", torch.stack(items))  # noqa: E731
    common = dict(batch_size=99, shuffle=False, drop_last=False, num_workers=0, pin_memory=False, seed=3)
    with caplog.at_level(logging.INFO, logger="lightlike"):
        train = build_train_data(DataLoader(data, batch_size=5, shuffle=True, drop_last=True, collate_fn=collate),
                                 **common)
    assert isinstance(train.sampler, ResumableSampler) and train.sampler.shuffle and train.sampler.seed == 3
    assert train.loader.batch_size == 5 and train.loader.drop_last and next(iter(train.loader))[0] == "mine"
    assert "RandomSampler is replaced by lightlike's ResumableSampler" in caplog.text
    assert "batch_size=5 is used, not the Fitter's batch_size=99" in caplog.text
    assert [r.levelno for r in caplog.records if "batch_size=5 is used" in r.getMessage()] == [logging.WARNING]
    epoch = torch.cat([b[1] for b in train.epoch_iterator(1)]).long().tolist()
    assert len(epoch) == 20 and len(set(epoch)) == 20
    assert torch.cat([b[1] for b in train.epoch_iterator(1, start_sample=10)]).long().tolist() == epoch[10:]
    dist = DistributedSampler(data, num_replicas=2, rank=1, seed=7)
    expected = list(dist)
    shares = build_train_data(DataLoader(data, batch_size=4, sampler=dist), **{**common, "rank": 1, "world_size": 2})
    assert isinstance(shares.sampler, ResumableSampler) and list(shares.sampler) == expected
    padded = DataLoader(data[:23], batch_size=4, sampler=DistributedSampler(data[:23], num_replicas=2, rank=0))
    assert build_train_data(padded, **{**common, "world_size": 2}).loader is padded  # it repeats an item: kept
    weighted = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler(torch.ones(24), 24))
    assert build_train_data(weighted, **common).loader is weighted
    replaced = RandomSampler(data, replacement=True)
    assert build_train_data(DataLoader(data, sampler=replaced), **common).loader.sampler is replaced

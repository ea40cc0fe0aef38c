"""``auto_find_batch_size`` under ``strategy="fsdp"`` on one process (what a 2 -> 1 resume runs):
the retry after an out-of-memory error mid-window ends with the weights of the same retry under
``strategy="single"``.

This file is also the plain-process target of its test: ``python THIS_FILE OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import DictDataset, TokenClassifier  # noqa: E402
from launching import launch  # noqa: E402

import lightlike as ll  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class RunsOutOnce(TokenClassifier):
    """Two shard units and a root; the 4th training forward (the second micro-batch of step 2,
    after the first one's backward) raises the CPU allocator's out-of-memory error."""

    forwards = 0

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 3))

    def forward(self, batch):
        if self.training:
            type(self).forwards += 1
            if type(self).forwards == 4:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return self.net(batch["x"])


def _target(out: Path) -> None:
    """Both strategies in one process, one after the other; the final weights saved for the test."""
    for strategy in ("single", "fsdp"):
        torch.manual_seed(0)
        RunsOutOnce.forwards = 0
        module = RunsOutOnce().double()
        fitter = ll.Fitter(strategy=strategy, max_steps=6, batch_size=8, grad_accum_steps=2, learning_rate=1e-2,
                           auto_find_batch_size=True, output_dir=str(out / strategy), save_strategy="no",
                           loggers=[], progress_bar=False, model_summary=False)
        fitter.fit(module, DictDataset(n=48, classes=3, dtype=torch.float64))
        weights = fitter.strategy.checkpoint_layout.module_state_dict(fitter.model)
        torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, out / f"{strategy}.pt")


def test_an_fsdp_retry_after_out_of_memory_mid_window_trains_as_the_single_device_one(tmp_path):
    """The retry restored the first weights with a plain ``load_state_dict`` into the DTensor
    parameters fully_shard left ("got mixed torch.Tensor and DTensor", the out-of-memory error
    buried under it); with that fixed, it kept FSDP's state of the aborted forward (the root
    still "in a forward") and the unsharded gradients of the window's first micro-batch, and
    ended with other weights than the single-device retry."""
    p = launch(1, tmp_path, script=Path(__file__).resolve(), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("retrying from the start with batch_size=4, grad_accum_steps=4") == 2, p.stderr[-3000:]
    single, fsdp = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "fsdp.pt")
    assert single.keys() == fsdp.keys()
    for k in single:
        torch.testing.assert_close(fsdp[k], single[k], rtol=1e-12, atol=1e-12, msg=k)


if __name__ == "__main__":
    _target(Path(sys.argv[1]))

"""A script tests/evaluation/test_eval_state.py launches with torchrun: what evaluation leaves behind on
several processes (module modes, BatchNorm statistics, FSDP's shards) and a set smaller than
the world with buffers. Rank r writes ``OUT/rank<r>.pt``.

    torchrun --nproc_per_node 2 eval_state_target.py OUT STRATEGY
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402


class Normed(Classifier):
    """A BatchNorm in front, and a dropout: its statistics differ by rank after training on the
    ranks' own batches; its mode shows in the outputs."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, batch):
        return self.net(self.drop(self.norm(batch["x"])))


def fitter(out, strategy, **kw):
    cfg = dict(max_steps=3, batch_size=4, learning_rate=1e-2, lr_scheduler="constant", output_dir=str(out),
               loggers=[], log_level="warning", strategy=strategy, overwrite_output_dir=True, model_summary=False)
    return ll.Fitter(**{**cfg, **kw})


DTYPE = torch.float64  # float32 under DeepSpeed, which refuses float64 (its masters are float32)


def fresh():
    torch.manual_seed(0)
    return Normed().to(DTYPE)


class Contiguous(torch.utils.data.IterableDataset):
    """Shards itself in contiguous blocks, as a reader of files does: rank r yields items
    r*ceil(n/W) ... (fewer on the last ranks, none on some)."""

    shards_itself = True

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        per = -(-self.n // world)
        return ({"x": torch.full((8,), float(i), dtype=torch.float64), "i": torch.tensor(i)}
                for i in range(rank * per, min(self.n, (rank + 1) * per)))


class Identity(Classifier):
    def predictions(self, outputs, batch):
        return batch["i"]

    def labels(self, batch):
        return None


def main():
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    if strategy == "self-sharded":  # predictions of a dataset that shards itself: rank by rank
        f = fitter(out, "auto", eval_batch_size=2)
        result = {n: f.predict(Identity().double(), Contiguous(n)).predictions.tolist() for n in (4, 10)}
        torch.save(result, out / f"rank{rank}.pt")
        return
    global DTYPE
    DTYPE = torch.float32 if strategy.startswith("deepspeed") else torch.float64
    train, val, tiny = (DictDataset(n=n, dtype=DTYPE, seed=s) for n, s in ((24, 0), (7, 1), (1, 2)))
    result = {}

    # modes: each submodule comes back as it went in, also a frozen norm in a training module
    module = fresh()
    module.eval()
    f = fitter(out / "a", strategy)
    f.validate(module, val)
    result["eval_mode_kept"] = not any(m.training for m in module.modules())
    module.train()
    module.norm.eval()
    f.validate(module, val)
    result["mixed_modes_kept"] = [m.training for m in module.modules()] == [m is not module.norm for m in module.modules()]

    # a fit after validate() trains as one without it (FSDP left the root unsharded: it did not)
    with_validate = fresh()
    f = fitter(out / "b", strategy)
    f.validate(with_validate, val)
    result["loss_after_validate"] = f.fit(with_validate, train).training_loss
    plain = fresh()
    result["loss_plain"] = fitter(out / "c", strategy).fit(plain, train).training_loss

    # after training the ranks' BatchNorm statistics differ: evaluation uses rank 0's, the
    # checkpoint's; and a one-item set (rank 1 has none) does not hang on DDP's buffer broadcast
    trained = fresh()
    f = fitter(out / "d", strategy)
    f.fit(trained, train)
    result["tiny"] = f.validate(trained, tiny)  # first: DDP's forward would broadcast the buffers now
    result["val"] = f.validate(trained, val)
    result["state"] = {k: v.detach().clone() for k, v in f.strategy.checkpoint_layout.module_state_dict(f.model).items()}
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()

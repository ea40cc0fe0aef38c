"""A script tests/evaluation/test_evaluation_on_ranks.py launches with torchrun: evaluation and data splitting on
several processes, several checks per launch. Each rank writes ``OUT/rank<r>.json``.

    torchrun --nproc_per_node 2 eval_target.py OUT
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "evaluation"))
from helpers import Classifier, DictDataset  # noqa: E402
from test_evaluation import Tagger, TokenMetricTagger, VarLen, pad_collate  # noqa: E402

import lightlike as ll  # noqa: E402


class Indexed(DictDataset):
    """DictDataset items with their index ``i``."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "i": torch.tensor(i)}


class Unlabelled(Indexed):
    def __getitem__(self, i):
        return {"x": self.x[i]}


class Stream(IterableDataset):
    def __init__(self, n):
        self.data = Indexed(n=n, dtype=torch.float64)

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


@dataclasses.dataclass
class Record:
    """A dataclass prediction (module level, so that it can travel between ranks)."""

    pred: torch.Tensor
    index: torch.Tensor
    doubled: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):  # runs once per batch: the joined object is not built again
        self.index = self.index + 1000
        self.doubled = self.index * 2


PairNT = collections.namedtuple("PairNT", "pred index")


class Batches(torch.utils.data.Dataset):
    """Ready-made batches of 3 ``Indexed`` items (``DataLoader(batch_size=None)``); ``by_list``:
    ``ds[list of indices]`` is the batch of those items (read with a BatchSampler as sampler)."""

    def __init__(self, n, by_list=False):
        self.data, self.by_list = Indexed(n=n, dtype=torch.float64), by_list

    def __len__(self):
        return len(self.data) if self.by_list else -(-len(self.data) // 3)

    def __getitem__(self, k):
        rows = k if self.by_list else range(3 * k, min(3 * k + 3, len(self.data)))
        return torch.utils.data.default_collate([self.data[i] for i in rows])


class BatchStream(IterableDataset):
    def __init__(self, n):
        self.batches = Batches(n)

    def __iter__(self):
        return (self.batches[k] for k in range(len(self.batches)))


class Module(Classifier):
    """Predictions: (index, argmax) per item, so order and duplicates show; whole-set metrics
    see every item once."""

    trained: list[int] = []

    def forward(self, batch):
        if self.training and "i" in batch:
            Module.trained.extend(batch["i"].tolist())
        return self.net(batch["x"])

    def metrics(self, outputs, batch):
        return {"accuracy": (outputs.argmax(-1) == batch["y"]).double().mean()}

    def predictions(self, outputs, batch):
        return outputs.argmax(-1)

    def compute_metrics(self, predictions, labels):
        return {"n": float(len(predictions)), "label_sum": float(labels.sum())}


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = Module().double()
    fitter = ll.Fitter(max_epochs=1, batch_size=2, eval_batch_size=2, output_dir=str(out / "run"), loggers=[],
                       log_level="warning", learning_rate=0.0)
    res: dict = {}
    # a set smaller than the world: ranks without a share join the collectives with nothing
    res["tiny_val"] = fitter.validate(model, Indexed(n=1, dtype=torch.float64))
    tiny = fitter.predict(model, Indexed(n=1, dtype=torch.float64))
    res["tiny_pred"] = [tiny.predictions.tolist(), tiny.labels.tolist(), tiny.metrics]
    # a DataLoader of the user's: split over ranks, each item once, in dataset order
    user = fitter.predict(model, DataLoader(Indexed(n=7, dtype=torch.float64), batch_size=2))
    res["user_loader"] = [user.predictions.tolist(), user.labels.tolist(), user.metrics]
    stream = fitter.predict(model, Stream(5))
    res["stream"] = [stream.predictions.tolist(), stream.labels.tolist(), stream.metrics]
    unlabelled = fitter.predict(model, Unlabelled(n=3, dtype=torch.float64))
    res["unlabelled"] = [unlabelled.predictions.tolist(), unlabelled.labels, unlabelled.metrics]
    # variable lengths: rank 0's batches are at most 3 tokens long, rank 1's 4 (2 ranks)
    torch.manual_seed(0)
    tagger = Tagger()
    tagged = fitter.predict(tagger, DataLoader(VarLen(9), batch_size=2, collate_fn=pad_collate))
    res["varlen"] = [tagged.predictions.tolist(), tagged.labels.tolist(), tagged.metrics]
    # a per-token metric in metrics(), weighted by num_items (real tokens) over the ranks' batches
    torch.manual_seed(0)
    res["token_metric"] = fitter.validate(TokenMetricTagger(), DataLoader(VarLen(9), batch_size=2, collate_fn=pad_collate))
    # training on a plain DataLoader: each rank its own share
    fitter.fit(model, DataLoader(Indexed(n=8, dtype=torch.float64), batch_size=2))
    res["trained"] = Module.trained

    class Pairs(Module):  # tuple predictions: fields, each joined in dataset order
        def predictions(self, outputs, batch):
            return outputs.argmax(-1), batch["i"] * 10

    pairs = fitter.predict(Pairs().double(), Indexed(n=7, dtype=torch.float64))
    res["pairs"] = [type(pairs.predictions).__name__, [t.tolist() for t in pairs.predictions]]
    # ready-made batches (batch_size=None): whole batches dealt to ranks, joined back in batch order
    sampled = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(7)), 3, False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lists = torch.utils.data.BatchSampler  # samplers that are split already or differ by rank are put in order
    shuffled = lists(torch.utils.data.RandomSampler(range(7), generator=torch.Generator().manual_seed(rank)), 3, False)
    split = lists(ll.data.ResumableSampler(7, shuffle=False, rank=rank, world_size=world), 3, False)
    dist = torch.utils.data.DistributedSampler(range(3), num_replicas=world, rank=rank, shuffle=False)
    for name, loader in (("map", DataLoader(Batches(7), batch_size=None)),
                         ("stream", DataLoader(BatchStream(7), batch_size=None)),
                         ("lists", DataLoader(Batches(7, by_list=True), batch_size=None, sampler=sampled)),
                         ("lists_shuffled", DataLoader(Batches(7, by_list=True), batch_size=None, sampler=shuffled)),
                         ("lists_split", DataLoader(Batches(7, by_list=True), batch_size=None, sampler=split)),
                         ("map_split", DataLoader(Batches(7), batch_size=None, sampler=dist))):
        torch.manual_seed(0)  # the weights of the reference's module
        got = fitter.predict(Pairs().double(), loader)
        res[f"prebatched_{name}"] = [[t.tolist() for t in got.predictions], got.labels.tolist()]
    # a SequentialSampler over the first items only: those items, on one process and on several
    first = torch.utils.data.SequentialSampler
    for name, loader in (("items", DataLoader(Indexed(n=7, dtype=torch.float64), batch_size=2, sampler=first(range(5)))),
                         ("batches", DataLoader(Batches(7), batch_size=None, sampler=first(range(2)))),
                         ("lists", DataLoader(Batches(7, by_list=True), batch_size=None,
                                              sampler=lists(first(range(5)), 3, False)))):
        torch.manual_seed(0)
        got = fitter.predict(Pairs().double(), loader)
        res[f"first_{name}"] = [[t.tolist() for t in got.predictions], got.labels.tolist()]

    class Records(Module):  # a dataclass and a namedtuple inside an OrderedDict: the types back, fields in order
        def predictions(self, outputs, batch):
            return collections.OrderedDict(rec=Record(outputs.argmax(-1), batch["i"]), i=PairNT(batch["i"], batch["i"]))

    for n in (7, 1):  # 1: ranks without a share send empty parts of the same form
        torch.manual_seed(0)  # the weights of the reference's module
        got = fitter.predict(Records().double(), Indexed(n=n, dtype=torch.float64)).predictions
        rec = got["rec"]
        res[f"records{n}"] = [type(got).__name__, type(rec).__name__, rec.pred.tolist(), rec.index.tolist(),
                              rec.doubled.tolist(), type(got["i"]).__name__, got["i"].index.tolist()]

    class RankKeys(Module):  # a metric only rank 0 reports: refused on every rank, none left waiting
        def metrics(self, outputs, batch):
            return {**super().metrics(outputs, batch), **({"extra": outputs.mean()} if rank == 0 else {})}

    try:
        fitter.validate(RankKeys().double(), Indexed(n=6, dtype=torch.float64))
    except ll.ModuleContractError as e:
        res["rank_keys"] = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()

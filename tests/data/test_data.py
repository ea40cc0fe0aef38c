"""Data utilities: the resumable sampler and IterableDataset sharding."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import Classifier
from torch.utils.data import DataLoader, IterableDataset

import lightlike as ll
from lightlike.data.iterable import ShardedIterable
from lightlike.data.sampler import ResumableSampler


class Count(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": torch.full((8,), float(i)), "y": torch.tensor(i % 3), "i": torch.tensor(i)}


def test_sampler_seek_and_ranks():
    full = list(ResumableSampler(23, seed=4))
    s = ResumableSampler(23, seed=4)
    s.set_epoch(0, start=10)
    assert list(s) == full[10:]
    shares = []
    for r in range(3):
        s = ResumableSampler(23, seed=4, rank=r, world_size=3)
        shares.append(list(s))
    assert sorted(sum(shares, [])) == list(range(23))  # evaluation: every item once, no padding
    even = [list(ResumableSampler(23, seed=4, rank=r, world_size=3, even=True)) for r in range(3)]
    assert [len(x) for x in even] == [7, 7, 7] and len(set(sum(even, []))) == 21


@pytest.mark.parametrize("n,world,seed,epoch", [(23, 3, 4, 0), (23, 3, 4, 2), (40, 4, 0, 3), (17, 2, 7, 5)])
def test_sampler_even_deals_torchs_distributed_sampler_order(n, world, seed, epoch):
    """even=True is torch's DistributedSampler(drop_last=True) with the same seed and epoch:
    a run moved between the two sees the same samples on every rank."""
    from torch.utils.data import DistributedSampler

    for rank in range(world):
        ours = ResumableSampler(n, seed=seed, rank=rank, world_size=world, even=True)
        ours.set_epoch(epoch)
        torchs = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed, drop_last=True)
        torchs.set_epoch(epoch)
        assert list(ours) == list(torchs)


def test_iterable_sharded_over_ranks_and_workers():
    seen = []
    for rank in range(2):
        loader = DataLoader(ShardedIterable(Count(20), rank, 2), batch_size=None, num_workers=2)
        seen += [int(item["i"]) for item in loader]
    assert sorted(seen) == list(range(20))


def test_fit_on_iterable_with_workers(tmp_path):
    ids = []

    class Record(ll.TaskModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 3)

        def forward(self, batch):
            ids.extend(batch["i"].tolist())
            return self.lin(batch["x"])

        def loss(self, outputs, batch):
            return torch.nn.functional.cross_entropy(outputs, batch["y"])

    # each worker holds 10 items: batches of 4, 4, 2 -> 6 batches in one pass
    ll.Fitter(max_steps=6, batch_size=4, num_workers=2, output_dir=str(tmp_path), loggers=[]).fit(Record(), Count(20))
    assert sorted(ids) == list(range(20))  # 2 workers, no item twice


# -- DataLoaders of the user's on several ranks (ranks simulated: rank/world_size arguments) ---------

def ids(loader):
    return [int(i) for batch in loader for i in batch["i"]]


def tagged_collate(items):
    batch = torch.utils.data.default_collate(items)
    batch["collated_by"] = "user"
    return batch


class Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "i": torch.tensor(i)}


def test_user_eval_loader_is_split_over_ranks_in_order(caplog):
    """A DataLoader passed for evaluation is rebuilt on each rank over a disjoint, in-order share
    (round-robin, so gathered outputs interleave back into dataset order), keeping its
    batch_size and collate_fn; a sampler it had is replaced, with a warning."""
    from lightlike.data.eval_loading import build_eval_loader

    user = DataLoader(Items(7), batch_size=2, shuffle=True, collate_fn=tagged_collate)
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        shares = [build_eval_loader(user, batch_size=5, num_workers=0, pin_memory=False, rank=r, world_size=2)
                  for r in range(2)]
    assert [ids(s) for s in shares] == [[0, 2, 4, 6], [1, 3, 5]]
    assert all(s.batch_size == 2 and next(iter(s))["collated_by"] == "user" for s in shares)
    assert sum("its sampler (RandomSampler) is replaced" in r.getMessage() for r in caplog.records) == 2
    # one process: the same items in the same order as on several (a shuffled or drop_last loader is
    # rebuilt, with the same warning); an in-order loader is used as it is
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        one = build_eval_loader(user, batch_size=5, num_workers=0, pin_memory=False)
        dropping = build_eval_loader(DataLoader(Items(7), batch_size=2, drop_last=True), batch_size=5,
                                     num_workers=0, pin_memory=False)
    assert ids(one) == list(range(7)) and ids(dropping) == list(range(7))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["the eval DataLoader is rebuilt for evaluation"] * 2
    plain = DataLoader(Items(7), batch_size=2, collate_fn=tagged_collate)
    assert build_eval_loader(plain, batch_size=5, num_workers=0, pin_memory=False) is plain
    tiny = [ids(build_eval_loader(DataLoader(Items(1)), batch_size=1, num_workers=0, pin_memory=False, rank=r,
                                  world_size=3)) for r in range(3)]
    assert tiny == [[0], [], []]  # a set smaller than the world: some ranks hold nothing


def test_iterable_eval_data_is_sharded_in_order_over_ranks_and_workers():
    """An IterableDataset for evaluation: each item once, and in order on each rank, with
    DataLoader workers too (one process with 2 workers used to evaluate every item twice)."""
    from lightlike.data.eval_loading import build_eval_loader

    one = build_eval_loader(Count(11), batch_size=2, num_workers=2, pin_memory=False)
    assert ids(one) == list(range(11))
    user = DataLoader(Count(11), batch_size=2, num_workers=2)
    shares = [ids(build_eval_loader(user, batch_size=4, num_workers=0, pin_memory=False, rank=r, world_size=2))
              for r in range(2)]
    assert shares == [list(range(0, 11, 2)), list(range(1, 11, 2))]
    # the same user DataLoader on one process: its 2 workers no longer each yield the whole stream
    assert ids(build_eval_loader(user, batch_size=4, num_workers=0, pin_memory=False)) == list(range(11))


def test_user_train_loader_is_split_over_ranks():
    """A plain DataLoader passed to fit on several ranks is rebuilt with lightlike's resumable
    sampler (each rank its own share, mid-epoch resume works), keeping batch_size, collate_fn,
    drop_last and its shuffle; one with a ResumableSampler for this job is kept as it is."""
    from lightlike.data.loading import build_train_data

    common = dict(batch_size=99, shuffle=True, drop_last=False, num_workers=0, pin_memory=False, seed=3)
    ordered = DataLoader(Items(9), batch_size=2, collate_fn=tagged_collate, drop_last=True)
    shares = [build_train_data(ordered, rank=r, world_size=2, **common) for r in range(2)]
    assert [ids(t.epoch_iterator(0)) for t in shares] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the 9th: left out
    assert all(isinstance(t.sampler, ResumableSampler) and t.loader.drop_last for t in shares)
    assert next(iter(shares[0].loader))["collated_by"] == "user"
    assert ids(shares[1].epoch_iterator(0, start_sample=4)) == [5, 7]  # resumes mid-epoch
    shuffled = DataLoader(Items(10), batch_size=2, shuffle=True)
    seen = [ids(build_train_data(shuffled, rank=r, world_size=2, **common).epoch_iterator(1)) for r in range(2)]
    assert sorted(seen[0] + seen[1]) == list(range(10)) and seen[0] + seen[1] != list(range(10))
    mine = DataLoader(Items(10), batch_size=2, sampler=ResumableSampler(10, rank=1, world_size=2))
    assert build_train_data(mine, rank=1, world_size=2, **common).loader is mine
    one = build_train_data(ordered, **common)  # one process: rebuilt in its own order, so that it seeks
    assert isinstance(one.sampler, ResumableSampler) and not one.sampler.shuffle and one.loader.drop_last
    assert ids(one.epoch_iterator(0)) == list(range(8)) and ids(one.epoch_iterator(0, start_sample=4)) == [4, 5, 6, 7]


def test_a_plain_batch_sampler_keeps_its_batch_size_drop_last_and_order():
    """DataLoader(batch_sampler=BatchSampler(sampler, 3, drop_last)) has loader.batch_size None:
    the split loader takes the BatchSampler's own size (and for training its drop_last and
    shuffle; evaluation never drops an item)."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    from lightlike.data.eval_loading import build_eval_loader
    from lightlike.data.loading import build_train_data

    ordered = DataLoader(Items(10), batch_sampler=BatchSampler(SequentialSampler(range(10)), 3, True))
    shares = [build_eval_loader(ordered, batch_size=2, num_workers=0, pin_memory=False, rank=r, world_size=2)
              for r in range(2)]
    assert [[len(b["i"]) for b in s] for s in shares] == [[3, 2], [3, 2]]  # evaluation keeps every item
    assert ids(shares[0]) == [0, 2, 4, 6, 8] and ids(shares[1]) == [1, 3, 5, 7, 9]
    shuffled = DataLoader(Items(12), batch_sampler=BatchSampler(RandomSampler(range(12)), 4, True))
    common = dict(batch_size=99, shuffle=True, drop_last=False, num_workers=0, pin_memory=False, seed=3)
    train = [build_train_data(shuffled, rank=r, world_size=2, **common) for r in range(2)]
    assert all(t.loader.batch_size == 4 and t.loader.drop_last for t in train)
    seen = [ids(t.epoch_iterator(0)) for t in train]  # 6 each: one batch of 4, 2 dropped
    assert len(seen[0]) == len(seen[1]) == 4 and len(set(seen[0] + seen[1])) == 8
    assert seen[0] + seen[1] != [0, 2, 4, 6, 1, 3, 5, 7]  # shuffled


def test_user_train_loader_that_cannot_be_kept(caplog):
    from torch.utils.data import WeightedRandomSampler

    from lightlike.data.loading import build_train_data

    common = dict(batch_size=99, shuffle=False, drop_last=False, num_workers=0, pin_memory=False, seed=3)
    weighted = DataLoader(Items(8), batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        t = build_train_data(weighted, rank=0, world_size=2, **common)
    assert ids(t.epoch_iterator(0)) == [0, 2, 4, 6]  # shuffle as configured (False here)
    assert any("sampler (WeightedRandomSampler) cannot be split over 2 processes" in r.getMessage()
               for r in caplog.records)
    wrong = DataLoader(Items(8), batch_size=2, sampler=ResumableSampler(8))  # built for one process
    with pytest.raises(ll.DataError, match="world_size=1 but the job runs 2 processes"):
        build_train_data(wrong, rank=0, world_size=2, **common)
    batches = DataLoader(Items(8), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ll.DataError, match=r"batch_sampler \(list\) has no batch_size"):
        build_train_data(batches, rank=0, world_size=2, **common)


def test_a_custom_batch_sampler_replaced_on_several_ranks_shuffles_as_the_fitter_says(caplog):
    """batch_sampler=MyBatches(): torch fills loader.sampler with a SequentialSampler placeholder,
    which was read as the user's choice (shuffle=False, the same batches every epoch)."""
    from lightlike.data.loading import build_train_data

    class MyBatches:
        batch_size = 3

        def __iter__(self):
            return iter([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]])

        def __len__(self):
            return 4

    loader = DataLoader(Items(12), batch_sampler=MyBatches())
    common = dict(batch_size=99, drop_last=False, num_workers=0, pin_memory=False, seed=3)
    train = build_train_data(loader, rank=0, world_size=2, shuffle=True, **common)
    assert "shuffle=True" in caplog.text and train.sampler.shuffle
    assert ids(train.epoch_iterator(0)) != ids(train.epoch_iterator(1))
    assert not build_train_data(loader, rank=0, world_size=2, shuffle=False, **common).sampler.shuffle


def test_a_sampler_deals_evenly_only_when_every_rank_gets_as_many_samples():
    """A ResumableSampler without even/drop_last on several processes gives the first n % W ranks
    one sample more: the loop then agrees on data and item counts every step (it assumed equal
    shares, and rank 0 waited for rank 1 at a step it never took)."""
    assert ResumableSampler(9, world_size=1).deals_evenly
    assert ResumableSampler(9, world_size=2, even=True).deals_evenly
    assert not ResumableSampler(9, world_size=2).deals_evenly
    assert [len(ResumableSampler(9, rank=r, world_size=2)) for r in range(2)] == [5, 4]


class SizedCount(Count):
    """Count with a ``__len__`` (``claims`` items, the true number unless it lies)."""

    def __init__(self, n, claims=None):
        super().__init__(n)
        self.claims = n if claims is None else claims

    def __len__(self):
        return self.claims


@pytest.mark.parametrize(("n", "world", "workers", "batch", "drop_last"), [
    (10, 1, 2, 4, False), (10, 1, 2, 4, True), (23, 2, 2, 3, False), (23, 3, 2, 4, True), (5, 3, 2, 2, False),
])
def test_sharded_iterable_counts_the_batches_a_dataloader_gives(n, world, workers, batch, drop_last):
    """Each worker batches its own shard, so its last batch may be short: the DataLoader's own
    len() (one stream) counts too few, e.g. 3 for 10 items in 2 workers of batch 4 (it gives 4)."""
    for rank in range(world):
        shard = ShardedIterable(SizedCount(n), rank, world)
        loader = DataLoader(shard, batch_size=batch, num_workers=workers, drop_last=drop_last)
        assert shard.batches(batch, drop_last, workers) == sum(1 for _ in loader), rank


def test_an_iterable_dataset_with_a_length_trains_by_epochs_with_workers(tmp_path, caplog):
    """It has a length, but sharded over DataLoader workers (or ranks) it was refused under
    max_epochs ("has no length: set max_steps"). Each epoch takes every item once (2 workers of 5
    items each, in batches of 4: 2 batches each, 4 in all, where the DataLoader's len() says 3),
    and the schedule is planned on them (a linear one's last step at 1/8 of the peak)."""
    seen: list[int] = []
    lrs: list[float] = []

    class Recorder(ll.Callback):
        def on_before_optimizer_step(self, fitter, state, control, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    class Module(Classifier):
        def forward(self, batch):
            seen.extend(batch["i"].tolist())
            return super().forward(batch)

    result = ll.Fitter(max_epochs=2, batch_size=4, num_workers=2, output_dir=str(tmp_path / "a"), loggers=[],
                       log_level="warning", callbacks=[Recorder()]).fit(Module(), SizedCount(10))
    assert result.global_step == 8 and sorted(seen) == sorted(list(range(10)) * 2)
    assert lrs[-1] == pytest.approx(1e-3 / 8) and result.state.epoch == 2.0
    # a __len__ that promises more than the data holds is said, once per short epoch
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        ll.Fitter(max_epochs=1, batch_size=4, output_dir=str(tmp_path / "b"), loggers=[],
                  log_level="warning").fit(Classifier(), SizedCount(10, claims=14))
    assert "promised 4 batch(es) of this epoch to this process and it ended after 3" in caplog.text
    # ... and one that holds more: the epoch ends at __len__, also inside an accumulation window
    # (one process took a whole window past it: 6 items of a 4-item epoch)
    seen.clear()
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        ll.Fitter(max_epochs=1, batch_size=2, grad_accum_steps=3, output_dir=str(tmp_path / "c"), loggers=[],
                  log_level="warning").fit(Module(), SizedCount(10, claims=4))
    assert seen == [0, 1, 2, 3] and "yields more than the 2 batch(es)" in caplog.text


def test_ready_made_batches_from_index_lists_are_split_only_by_a_split_sampler():
    """A training DataLoader(batch_size=None, sampler=BatchSampler(...)) on several processes: the
    index lists cannot be dealt out (the sampler was replaced by one of single indices and every
    rank failed on its first batch with "'int' object is not iterable"): refused naming the fix,
    and that fix (the BatchSampler over a ResumableSampler of this rank) is kept as it is."""
    from torch.utils.data import BatchSampler, SequentialSampler

    from lightlike.data.loading import build_train_data
    from lightlike.errors import DataError

    class Rows(torch.utils.data.Dataset):  # data[list of indices] is a batch: the indices themselves
        def __len__(self):
            return 12

        def __getitem__(self, rows):
            return list(rows)

    data = Rows()
    plain = DataLoader(data, batch_size=None, sampler=BatchSampler(SequentialSampler(data), 3, False))
    with pytest.raises(DataError, match=r"ready-made batches.*batch_size=\.\.\..*BatchSampler\(DistributedSampler"):
        build_train_data(plain, batch_size=3, shuffle=True, drop_last=False, seed=0, num_workers=0, pin_memory=False,
                         rank=1, world_size=2)
    split = DataLoader(data, batch_size=None,
                       sampler=BatchSampler(ResumableSampler(12, shuffle=False, rank=1, world_size=2), 3, False))
    kept = build_train_data(split, batch_size=3, shuffle=True, drop_last=False, seed=0, num_workers=0,
                            pin_memory=False, rank=1, world_size=2).loader
    assert kept is split and list(kept) == [[1, 3, 5], [7, 9, 11]]


def test_a_sampler_inside_a_batch_sampler_is_told_the_epoch(tmp_path):
    """DataLoader(batch_sampler=BatchSampler(DistributedSampler(...))) and a BatchSampler passed as
    sampler= over one: the DistributedSampler reshuffles each epoch only when told the epoch
    (set_epoch was called on the loader's sampler alone: the same order every epoch)."""
    from torch.utils.data import BatchSampler, DistributedSampler

    class Indexed(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):  # an index, or a list of them (a batched read)
            rows = torch.as_tensor(i).reshape(-1)
            return {"x": torch.ones(len(rows), 8) if isinstance(i, list) else torch.ones(8),
                    "y": rows % 3 if isinstance(i, list) else rows[0] % 3, "i": rows if isinstance(i, list) else rows[0]}

    class Seen(Classifier):
        def forward(self, batch):
            if self.training:
                self.seen.append(batch["i"].tolist())
            return super().forward(batch)

    def want(epoch):
        s = DistributedSampler(range(8), num_replicas=2, rank=0, seed=3)
        s.set_epoch(epoch)
        return [list(s)[k:k + 2] for k in (0, 2)]

    for how in ("batch_sampler", "sampler"):
        batches = BatchSampler(DistributedSampler(range(8), num_replicas=2, rank=0, seed=3), 2, False)
        loader = DataLoader(Indexed(), batch_sampler=batches) if how == "batch_sampler" else \
            DataLoader(Indexed(), batch_size=None, sampler=batches)
        model = Seen()
        model.seen = []
        ll.Fitter(max_epochs=3, output_dir=str(tmp_path / how), loggers=[], save_strategy="no").fit(model, loader)
        assert model.seen == want(0) + want(1) + want(2) and want(0) != want(1), how


def test_a_user_loader_without_generator_leaves_the_gpu_random_stream_alone(tmp_path, monkeypatch):
    """A DataLoader of the user's without ``generator=`` draws its base seed from the CPU
    generator as each epoch's iterator starts; lightlike draws it from (seed, epoch) in a fork of
    the CPU generator. It seeded with ``torch.manual_seed``, which reseeds every CUDA generator
    too, and the fork restores the CPU's alone: on a GPU, dropout restarted from seed + epoch at
    every epoch and a resumed run diverged (seen on an H200: tests/checkpoint/test_resume.py's two resumes
    with a user loader). Every reseed of the CUDA generators in a three-epoch fit is recorded
    here (torch records it lazily without a GPU): the Fitter's own seeding, as it is built and as
    the fit starts, is the only one (it was [5, 5, 5, 6, 7])."""
    from helpers import DictDataset

    seeds = []
    real = torch.cuda.manual_seed_all
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: (seeds.append(s), real(s))[1])
    loader = DataLoader(DictDataset(n=12), batch_size=4, shuffle=True)
    ll.Fitter(max_epochs=3, seed=5, accelerator="cpu", output_dir=str(tmp_path), loggers=[], save_strategy="no",
              model_summary=False).fit(Classifier(), loader)
    assert seeds == [5, 5]

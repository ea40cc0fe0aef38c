"""Sample counts of the FitState for DataLoaders of the user's and streams (short last batches,
batch samplers, a DistributedSampler's padding, ranks whose streams end apart), and evaluation
with a sampler of the user's (its own items, on one process as on several)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts.data_counts_target import Items, Lists, Model, Stream  # what the two-rank script runs
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    SubsetRandomSampler,
)

import lightlike as ll
from lightlike.data.eval_loading import build_eval_loader
from lightlike.data.loading import build_train_data

SCRIPT = Path(__file__).parents[1] / "scripts" / "data_counts_target.py"


def fit(tmp_path, data, **kw):
    model = Model()
    result = ll.Fitter(**{"max_epochs": 1, "batch_size": 4, "output_dir": str(tmp_path), "loggers": [],
                          "log_level": "error", "save_strategy": "no", **kw}).fit(model, data)
    return model.items, result


def fitter(tmp_path):
    return ll.Fitter(output_dir=str(tmp_path), loggers=[], log_level="error", eval_batch_size=4)


VAL = [15, 16, 17, 18, 19]


# -- evaluation with a sampler of the user's ------------------------------------------------------

def test_a_subset_random_sampler_evaluates_only_its_indices_on_one_process(tmp_path):
    """predict(DataLoader(ds, sampler=SubsetRandomSampler(VAL))) evaluates the 5 items of VAL (all 20 were)."""
    ds, model = Items(20), Model()
    with torch.no_grad():
        batch = ds[VAL]
        want = model.loss(model(batch), batch).item()
    got = fitter(tmp_path).predict(model, DataLoader(ds, batch_size=4, sampler=SubsetRandomSampler(VAL)))
    assert got.predictions.tolist() == VAL and got.metrics["predict/loss"] == pytest.approx(want, abs=1e-6)


def test_a_sampler_yielding_index_lists_is_kept_on_one_process(tmp_path):
    """DataLoader(batch_size=None, sampler=<index lists, not a BatchSampler>) is used as it is (10 items, not 20)."""
    got = fitter(tmp_path).predict(Model(), DataLoader(Items(20), batch_size=None, sampler=Lists()))
    assert got.predictions.tolist() == list(range(10))


def test_eval_samplers_are_split_over_ranks_by_their_own_indices():
    """On 2 (simulated) ranks a SubsetRandomSampler's indices and a sampler's index lists are dealt, not the dataset."""
    subset = DataLoader(Items(20), batch_size=2, sampler=SubsetRandomSampler(VAL))
    shares = [build_eval_loader(subset, batch_size=4, num_workers=0, pin_memory=False, rank=r, world_size=2)
              for r in range(2)]
    assert [[int(i) for b in s for i in b["i"]] for s in shares] == [[15, 17, 19], [16, 18]]
    lists = DataLoader(Items(20), batch_size=None, sampler=Lists())
    shares = [build_eval_loader(lists, batch_size=4, num_workers=0, pin_memory=False, rank=r, world_size=2)
              for r in range(2)]
    assert [[b["i"].tolist() for b in s] for s in shares] == [[[0, 1, 2], [5, 6, 7, 8]], [[3, 4], [9]]]


def test_a_sampler_of_index_lists_is_refused_for_training_on_several_ranks():
    """Training cannot deal a sampler's index lists out: refused, as for a BatchSampler passed as sampler=."""
    loader = DataLoader(Items(20), batch_size=None, sampler=Lists())
    with pytest.raises(ll.DataError, match=r"sampler of index lists \(Lists"):
        build_train_data(loader, batch_size=4, shuffle=False, drop_last=False, num_workers=0, pin_memory=False,
                         seed=0, rank=0, world_size=2)


# -- samples_seen on one process --------------------------------------------------------------------

def test_a_dataloader_counts_its_short_last_batch(tmp_path):
    """DataLoader(ds, batch_size=4) over 10 items: samples_seen 10 (it said 12, 3 batches x 4)."""
    items, result = fit(tmp_path, DataLoader(Items(10), batch_size=4, shuffle=True))
    assert items == result.state.samples_seen == 10


def test_a_batch_sampler_loader_counts_items_not_batches(tmp_path):
    """DataLoader(batch_sampler=BatchSampler(..., 4, False)) over 10 items: samples_seen 10 (it said 3)."""
    loader = DataLoader(Items(10), batch_sampler=BatchSampler(SequentialSampler(range(10)), 4, False))
    items, result = fit(tmp_path, loader)
    assert items == result.state.samples_seen == 10


def test_ready_made_batches_of_a_batch_sampler_count_items(tmp_path):
    """DataLoader(batch_size=None, sampler=BatchSampler(..., 3, False)) over 10 items: 10 (it said 4 batches)."""
    loader = DataLoader(Items(10), batch_size=None, sampler=BatchSampler(SequentialSampler(range(10)), 3, False))
    items, result = fit(tmp_path, loader)
    assert items == result.state.samples_seen == 10


def test_a_batch_sampler_of_the_users_counts_its_batch_lengths(tmp_path):
    """A batch_sampler of the user's with batches of 4, 1, 3 and 2 items: samples_seen 10 (it said 4)."""
    class Buckets:
        batch_size = 4

        def __iter__(self):
            return iter([[0, 1, 2, 3], [4], [5, 6, 7], [8, 9]])

        def __len__(self):
            return 4

    items, result = fit(tmp_path, DataLoader(Items(10), batch_sampler=Buckets()))
    assert items == result.state.samples_seen == 10


@pytest.mark.parametrize("claims", [10, None])
def test_an_iterable_dataset_counts_its_short_last_batch(tmp_path, claims):
    """A stream of 10 items in batches of 4 (with or without a __len__): samples_seen 10 (it said 12)."""
    kw = {} if claims else {"max_epochs": None, "max_steps": 3}  # the epoch ends at step 3
    items, result = fit(tmp_path, Stream(10, claims), **kw)
    assert items == result.state.samples_seen == 10


# -- on two ranks (one torchrun of scripts/data_counts_target.py, shared by these tests) ------------

@pytest.fixture(scope="module")
def two_ranks(shared_run):
    out = shared_run(2, script=SCRIPT)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_agree_on_the_fit_state_when_their_streams_end_apart(two_ranks):
    """A 13-item stream on 2 ranks (7 and 6 items), batch 2, accumulation 2: every rank holds samples_seen 13
    and the same epoch at every step (rank 0 said 16, rank 1 12; epoch 0.8 vs 0.6 with a __len__ of 21)."""
    for case in ("stream-no-length", "stream-over-claiming"):
        r0, r1 = (res[case] for res in two_ranks)
        assert r0["rows"] == r1["rows"], case
        assert r0["rows"][-1][1] == r0["items_trained"] == 13, case


def test_samples_seen_on_two_ranks_counts_items_without_padding(two_ranks):
    """One epoch in batches of 4 on 2 ranks: a 10-item stream counts 10, a DistributedSampler over 9 items 9 (both said 16)."""
    res = two_ranks[0]
    assert res["stream-with-length"]["rows"][-1][1] == res["stream-with-length"]["items_trained"] == 10
    assert res["distributed-sampler-9"]["rows"][-1][1] == 9  # 10 trained: the sampler's padding repeats one


def test_eval_samplers_on_two_ranks_give_the_items_of_one_process(two_ranks):
    """On 2 ranks predict() returns the items the user's sampler gives, in its order, as on one process (it gave all 20)."""
    res = two_ranks[0]
    assert res["subset-random-sampler"] == res["batch-sampler-over-a-subset"] == VAL
    assert res["sampler-of-index-lists"] == list(range(10))
    assert res["batch-sampler-of-the-users"] == list(range(19, 9, -1))

"""Epoch positions and data set-up the rest of the suite left open (mutation testing, audit
round 10): a short last batch is trained on, drop_last ends the epoch at its last whole batch
(before that step's checkpoint), the epoch fraction on uneven world sizes, worker seeds per
epoch, and the set-up of user loaders on several ranks (built here without processes)."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset
from torch.utils.data import DataLoader, Dataset, RandomSampler

import lightlike as ll
from lightlike.data.eval_loading import build_eval_loader
from lightlike.data.loading import build_train_data
from lightlike.data.sampler import ResumableSampler


class Events(ll.Callback):
    def __init__(self):
        self.events = []

    def on_epoch_end(self, fitter, state, control):
        self.events.append(("epoch_end", state.global_step))

    def on_save(self, fitter, state, control, *args, **kwargs):
        self.events.append(("save", state.global_step, state.epoch_index, state.samples_in_epoch))


@pytest.mark.parametrize("n,drop_last,expected", [
    # 9 items in batches of 4: the third step takes the 1-item batch, then the epoch ends
    (9, False, [("save", 1, 0, 4), ("save", 2, 0, 8), ("epoch_end", 3), ("save", 3, 1, 0),
                ("save", 4, 1, 4), ("save", 5, 1, 8), ("epoch_end", 6), ("save", 6, 2, 0)]),
    # drop_last: the 2 items left over are no batch, and the epoch ends at the step that took
    # the last whole one, before that step's checkpoint (it says epoch 1, sample 0)
    (10, True, [("save", 1, 0, 4), ("epoch_end", 2), ("save", 2, 1, 0),
                ("save", 3, 1, 4), ("epoch_end", 4), ("save", 4, 2, 0)]),
])
def test_epoch_ends_at_its_last_batch(tmp_path, n, drop_last, expected):
    events = Events()
    ll.Fitter(max_epochs=2, batch_size=4, drop_last=drop_last, save_every=1, output_dir=str(tmp_path),
              loggers=[], callbacks=[events], log_level="error").fit(Classifier(), DictDataset(n=n))
    assert events.events == expected


def train_data(n, world_size, rank=0, **kw):
    return build_train_data(DictDataset(n=n), **{**dict(batch_size=1, shuffle=False, drop_last=False, num_workers=0,
                                                        pin_memory=False, seed=0, rank=rank, world_size=world_size),
                                                 **kw})


def test_epoch_fraction_counts_the_samples_dealt_on_an_uneven_world():
    """10 items on 3 ranks: 9 are dealt per epoch; the fraction is over those 9, and a resume
    that starts at sample 1 (from another world size: 10 - 1 splits evenly) never passes 1.0."""
    data = train_data(10, 3)
    data.epoch_iterator(0, 0)
    position = data.position(0, 0, 3)
    assert position.advance(1)[:2] == (3, pytest.approx(3 / 9))
    assert position.advance(1)[:2] == (6, pytest.approx(6 / 9))
    assert position.advance(1) == (9, 1.0, True)
    data.epoch_iterator(0, 1)
    position = data.position(1, 0, 3)
    fractions = [position.advance(1)[1] for _ in range(3)]
    assert fractions[-1] == 1.0 and all(0 < f <= 1.0 for f in fractions)


class Noisy(Dataset):
    """Each read draws from torch's global generator (a random augmentation)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"x": torch.rand(8), "y": torch.tensor(i % 3)}


def test_worker_seeds_differ_by_epoch_and_repeat_by_seed():
    """The DataLoader workers' seeds come from (seed, epoch): another epoch draws other
    augmentations, the same epoch again draws the same ones."""
    def epoch(data, e):
        return torch.cat([b["x"] for b in data.epoch_iterator(e)])

    data = build_train_data(Noisy(), batch_size=2, shuffle=False, drop_last=False, num_workers=1,
                            pin_memory=False, seed=5)
    first, second, first_again = epoch(data, 0), epoch(data, 1), epoch(data, 0)
    assert torch.equal(first, first_again) and not torch.equal(first, second)


def test_drop_last_with_less_than_a_batch_per_rank_is_refused_at_set_up():
    """10 items, batch 3, 4 ranks: 2 items per rank, no whole batch: a clear error at set-up."""
    with pytest.raises(ll.DataError, match="drop_last=True with batch_size=3"):
        train_data(10, 4, batch_size=3, drop_last=True)


def test_a_user_eval_loader_positioned_mid_epoch_is_rebuilt_on_several_ranks():
    """An evaluation loader whose ResumableSampler starts past sample 0 would leave items out:
    it is rebuilt (every item once), as any loader lightlike would not build itself."""
    sampler = ResumableSampler(10, shuffle=False, rank=0, world_size=2)
    sampler.set_epoch(0, start=4)
    loader = DataLoader(DictDataset(n=10), batch_size=2, sampler=sampler)
    built = build_eval_loader(loader, batch_size=2, num_workers=0, pin_memory=False, rank=0, world_size=2)
    assert built is not loader and list(built.sampler) == [0, 2, 4, 6, 8]


def test_a_random_sampler_with_replacement_is_not_kept_as_a_shuffle():
    """Split over ranks, a RandomSampler that draws with replacement (or a set number of
    samples) cannot be kept: the Fitter's shuffle setting decides (here off)."""
    ds = DictDataset(n=8)
    loader = DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True))
    data = build_train_data(loader, batch_size=2, shuffle=False, drop_last=False, num_workers=0,
                            pin_memory=False, seed=0, rank=0, world_size=2)
    assert isinstance(data.sampler, ResumableSampler) and data.sampler.shuffle is False
    plain = DataLoader(ds, batch_size=2, sampler=RandomSampler(ds))
    data = build_train_data(plain, batch_size=2, shuffle=False, drop_last=False, num_workers=0,
                            pin_memory=False, seed=0, rank=0, world_size=2)
    assert data.sampler.shuffle is True  # a plain RandomSampler is kept as a shuffle

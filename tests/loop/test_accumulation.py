"""Exact gradient accumulation: the step's gradient is the gradient of the mean loss over every
item in the step, however the items are split into micro-batches and however many each holds."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset, TokenClassifier, flat_grads

import lightlike as ll


class GradRecorder(ll.Callback):
    """Records the (unscaled, unclipped) gradient at every optimizer step."""

    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.grads.append(flat_grads(fitter.module).clone())


def reference_grad(module_cls, data, indices):
    """Gradient of the mean loss over all items in ``indices``, computed in one batch."""
    torch.manual_seed(0)
    model = module_cls().double()
    batch = {k: torch.stack([data[i][k] for i in indices]) for k in ("x", "y", "w")}
    model.zero_grad()
    out = model(batch)
    if module_cls is TokenClassifier:
        per = torch.nn.functional.cross_entropy(out, batch["y"], reduction="none")
        loss = (per * batch["w"]).sum() / batch["w"].sum()
    else:
        loss = model.loss(out, batch)
    loss.backward()
    return flat_grads(model)


def fitted_grads(module_cls, data, batch_size, accum, steps, tmp_path):
    torch.manual_seed(0)
    model = module_cls().double()
    rec = GradRecorder()
    ll.Fitter(max_steps=steps, batch_size=batch_size, grad_accum_steps=accum, shuffle=False,
              learning_rate=0.0, output_dir=str(tmp_path / f"b{batch_size}a{accum}"), loggers=[],
              model_summary=False, callbacks=[rec], accelerator="cpu").fit(model, data)
    return rec.grads


@pytest.mark.parametrize("module_cls", [Classifier, TokenClassifier])
@pytest.mark.parametrize("batch_size,accum", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_same_gradient_for_every_split(tmp_path, module_cls, batch_size, accum):
    data = DictDataset(n=16, dtype=torch.float64)
    grads = fitted_grads(module_cls, data, batch_size, accum, steps=2, tmp_path=tmp_path)
    assert len(grads) == 2
    for step, indices in enumerate([range(0, 8), range(8, 16)]):
        ref = reference_grad(module_cls, data, list(indices))
        torch.testing.assert_close(grads[step], ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("module_cls", [Classifier, TokenClassifier])
def test_partial_window_normalised_by_what_it_holds(tmp_path, module_cls):
    # 11 items, batch 2, accumulation 4: batches of 2,2,2,2 | 2,1 -> the second step holds
    # 3 items in 2 micro-batches and must be their exact mean, not divided by 4 micro-batches
    data = DictDataset(n=11, dtype=torch.float64)
    grads = fitted_grads(module_cls, data, batch_size=2, accum=4, steps=2, tmp_path=tmp_path)
    assert len(grads) == 2
    torch.testing.assert_close(grads[0], reference_grad(module_cls, data, list(range(8))), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[1], reference_grad(module_cls, data, list(range(8, 11))), rtol=1e-12, atol=1e-14)


def test_mean_of_means_would_differ(tmp_path):
    """Guard that the uneven test above can fail: the naive mean of micro-batch means differs."""
    data = DictDataset(n=11, dtype=torch.float64)
    exact = reference_grad(Classifier, data, list(range(8, 11)))
    naive = (reference_grad(Classifier, data, [8, 9]) + reference_grad(Classifier, data, [10])) / 2
    assert not torch.allclose(exact, naive, rtol=1e-6)


def test_epoch_shorter_than_window_steps_once(tmp_path):
    # 3 batches per epoch with accumulation 8: one step per epoch holding all 3 batches
    data = DictDataset(n=6, dtype=torch.float64)
    torch.manual_seed(0)
    rec = GradRecorder()
    result = ll.Fitter(max_epochs=2, batch_size=2, grad_accum_steps=8, shuffle=False, learning_rate=0.0,
                       output_dir=str(tmp_path), loggers=[], model_summary=False, callbacks=[rec],
                       ).fit(Classifier().double(), data)
    assert result.global_step == 2
    torch.testing.assert_close(rec.grads[0], reference_grad(Classifier, data, list(range(6))), rtol=1e-12, atol=1e-14)


class ListItems(torch.utils.data.Dataset):
    """DictDataset's items with the features as a list of floats: torch's default collate makes a
    batch's ``x`` a list of 8 tensors of one value per item, and ``ids`` a list of strings."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        item = self.data[i]
        return {"x": item["x"].tolist(), "ids": f"item-{i}", "y": item["y"]}


class ListClassifier(Classifier):
    def forward(self, batch):
        return self.net(torch.stack(batch["x"], dim=-1).to(self.net[0].weight.dtype))


def test_default_item_count_of_list_fields(tmp_path):
    """The default num_items counted the first list's length: 8 features for every batch, the
    one-item last micro-batch included, which weighted the step's mean wrongly (1/2 where it is
    1/3). It counts rows: the first tensor's, then a list of strings' length."""
    data = DictDataset(n=11, dtype=torch.float64)
    loader = torch.utils.data.DataLoader(ListItems(data), batch_size=2)
    module = ListClassifier()
    assert [module.num_items(b) for b in loader] == [2, 2, 2, 2, 2, 1]
    assert module.num_items({"ids": ["a", "b", "c"], "meta": {"n": 3}}) == 3
    assert module.num_items(([torch.zeros(5), torch.zeros(5)], torch.zeros(5))) == 5
    # a list of one entry per item stays its length (review AS): variable-length sequences (a
    # first version counted the first sequence's length), equal-length ones, strings first
    seqs = [torch.zeros(n) for n in (9, 5, 7)]
    assert module.num_items((seqs, torch.zeros(3))) == 3
    assert module.num_items(([torch.zeros(5)] * 3, torch.zeros(3))) == 3
    assert module.num_items({"text": ["a", "b", "c"], "mask": torch.zeros(7, 7), "labels": torch.zeros(3)}) == 3
    # review AT: equal-length sequences beside a mask of their length; a batch that is the list
    # of its items (a collate_fn that keeps them)
    assert module.num_items({"seqs": [torch.zeros(5)] * 3, "mask": torch.zeros(5, 5), "labels": torch.zeros(3)}) == 3
    assert module.num_items([{"x": torch.zeros(4)}] * 3) == 3
    assert module.num_items([(torch.zeros(2), torch.tensor(1))] * 3) == 3
    # review AU: tuples of fields stay fields (a first version read them as lists of items)
    assert module.num_items(({"x": torch.zeros(4, 2)}, {"y": torch.zeros(4)})) == 4
    assert module.num_items((torch.zeros(4, 5), torch.zeros(5, 5), torch.zeros(4))) == 4
    assert module.num_items((torch.zeros(4, 5), torch.zeros(3), torch.zeros(4))) == 4
    assert module.num_items((torch.zeros(4, 5), torch.zeros(20))) == 4
    torch.manual_seed(0)
    model = ListClassifier().double()
    rec = GradRecorder()
    ll.Fitter(max_steps=2, batch_size=2, grad_accum_steps=4, shuffle=False, learning_rate=0.0,
              output_dir=str(tmp_path / "run"), loggers=[], model_summary=False, callbacks=[rec]).fit(model, ListItems(data))
    assert len(rec.grads) == 2
    torch.testing.assert_close(rec.grads[1], reference_grad(Classifier, data, [8, 9, 10]), rtol=1e-12, atol=1e-14)


def test_a_num_items_set_on_the_instance_is_the_count(tmp_path):
    """The loop reads the default count without the method call; a ``num_items`` the user sets
    on the instance (not the class) must still be the one used, for the weights and the log."""
    module = Classifier()
    seen = []

    def count_half(batch):
        seen.append(batch["x"].shape[0])
        return batch["x"].shape[0] // 2

    module.num_items = count_half
    ll.Fitter(max_steps=3, batch_size=4, grad_accum_steps=2, output_dir=str(tmp_path / "run"), loggers=[],
              model_summary=False).fit(module, DictDataset())
    assert seen == [4] * 6

"""Evaluation behaviour the rest of the suite left open (mutation testing, audit round 10):
the module's own train() override sees its real mode, an empty stream is an error, streaming
metric objects are reset and used only when meant, bool metrics are refused, is_improvement
is strict, and several processes refuse streaming metrics that do not reduce."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset
from torch.utils.data import DataLoader, IterableDataset

import lightlike as ll
from lightlike.errors import ConfigError, ModuleContractError
from lightlike.evaluation import is_improvement, run_evaluation


class Count:
    """A streaming metric: the number of items it was updated with."""

    def __init__(self):
        self.n = 0

    def reset(self):
        self.n = 0

    def update(self, outputs, batch):
        self.n += len(outputs)

    def compute(self):
        return float(self.n)


def fitter(tmp_path, **kw):
    return ll.Fitter(max_steps=1, eval_batch_size=3, output_dir=str(tmp_path), loggers=[], **kw)


def test_an_eval_mode_module_is_given_back_through_its_own_train_false(tmp_path):
    """validate() on a module in eval mode: its train() override runs with False at the end,
    never with True (its own flag would say training while the module is in eval mode)."""
    class Flagged(Classifier):
        def __init__(self):
            super().__init__()
            self.noise = True

        def train(self, mode=True):
            super().train(mode)
            self.noise = mode
            return self

    module = Flagged().eval()
    fitter(tmp_path).validate(module, DictDataset(n=4))
    assert not module.training and module.noise is False


class Empty(IterableDataset):
    def __iter__(self):
        return iter(())


@pytest.mark.parametrize("data", ["iterable", "loader"])
def test_an_evaluation_set_without_batches_is_an_error(tmp_path, data):
    """One process: a set that yields nothing is a DataError, not empty metrics."""
    data = Empty() if data == "iterable" else DataLoader(Empty(), batch_size=2)
    with pytest.raises(ll.DataError, match="produced no batches"):
        fitter(tmp_path).validate(Classifier(), data)


def test_streaming_metrics_kept_on_the_module_are_reset_for_each_evaluation(tmp_path):
    """A metric object the module holds (as torchmetrics attributes are held) counts each
    evaluation afresh: the second validate() gives the same value as the first."""
    class Held(Classifier):
        def __init__(self):
            super().__init__()
            self.count = Count()

        def streaming_metrics(self):
            return {"count": self.count}

    module, f = Held(), fitter(tmp_path)
    first = f.validate(module, DictDataset(n=7))
    second = f.validate(module, DictDataset(n=7))
    assert first["val/count"] == second["val/count"] == 7.0


def test_compute_metrics_wins_over_streaming_metrics_unless_asked(tmp_path):
    """A module with both: compute_metrics is used, the streaming objects only with
    eval_streaming=True (then compute_metrics is not)."""
    class Both(Classifier):
        def predictions(self, outputs, batch):
            return outputs.argmax(-1)

        def compute_metrics(self, predictions, labels):
            return {"whole": float(len(predictions))}

        def streaming_metrics(self):
            return {"stream": Count()}

    plain = fitter(tmp_path).validate(Both(), DictDataset(n=5))
    assert plain["val/whole"] == 5.0 and "val/stream" not in plain
    streamed = fitter(tmp_path, eval_streaming=True).validate(Both(), DictDataset(n=5))
    assert streamed["val/stream"] == 5.0 and "val/whole" not in streamed


def test_predict_on_unlabelled_data_leaves_streaming_metrics_out(tmp_path):
    """Without labels, predict() reports no metrics, streaming ones included (they saw nothing)."""
    class Streams(Classifier):
        def streaming_metrics(self):
            return {"count": Count()}

    data = [{"x": torch.randn(8)} for _ in range(5)]
    result = fitter(tmp_path).predict(Streams(), data)
    assert result.metrics == {} and result.labels is None and result.predictions.shape == (5, 3)


def test_a_bool_metric_is_refused(tmp_path):
    class Boolish(Classifier):
        def metrics(self, outputs, batch):
            return {"ok": True}

    with pytest.raises(ModuleContractError, match=r"metrics\(\)\['ok'\] is a bool"):
        fitter(tmp_path).validate(Boolish(), DictDataset(n=4))


@pytest.mark.parametrize("greater", [True, False])
def test_an_equal_value_is_no_improvement(greater):
    assert not is_improvement(0.5, 0.5, greater)
    assert not is_improvement(0.5, 0.5, greater, min_delta=0.0)
    assert is_improvement(0.6 if greater else 0.4, 0.5, greater)




def test_streaming_metrics_that_do_not_reduce_are_refused_on_several_processes():
    """Before any batch: a metric object without reduces_across_ranks would give each rank's
    own value on several processes."""
    from lightlike.strategies.single import SingleDeviceStrategy

    class Two(SingleDeviceStrategy):
        @property
        def world_size(self):
            return 2

    class Streams(Classifier):
        def streaming_metrics(self):
            return {"count": Count()}

    module = Streams()
    loader = DataLoader(DictDataset(n=4), batch_size=2)
    with pytest.raises(ConfigError, match="must reduce across ranks"):
        run_evaluation(module, module, loader, Two("cpu"), "val")


def test_greater_is_better_false_is_kept_for_any_name():
    """An explicit greater_is_better=False holds for a name that does not end in 'loss'."""
    from lightlike.evaluation import greater_is_better

    assert greater_is_better("val/error_rate", False) is False
    assert greater_is_better("val/loss", True) is True
    # unset, the name decides: an error rate is lower-is-better too (tests/loop/test_bad_input_messages.py)
    assert greater_is_better("val/error_rate", None) is False and greater_is_better("val/loss", None) is False


class ListIndexed(DictDataset):
    """``ds[list of indices]`` is the batch of those items (a batched read, as HF datasets do)."""

    def __getitem__(self, rows):
        return torch.utils.data.default_collate([super(ListIndexed, self).__getitem__(i) for i in rows])


class ArgMax(Classifier):
    def predictions(self, outputs, batch):
        return outputs.argmax(-1)


def test_ready_made_batches_keep_a_sampler_that_yields_index_lists(tmp_path):
    """DataLoader(batch_size=None, sampler=BatchSampler(...)): each element is a batch the sampler's
    index lists make; evaluation keeps that sampler (it replaced it with one of single indices, and
    the dataset got an int). A shuffling sampler of ready-made batches is still put in order."""
    torch.manual_seed(0)
    model = ArgMax()
    data = ListIndexed(n=7)
    with torch.no_grad():
        want = model(data[list(range(7))]).argmax(-1)
    fitter = ll.Fitter(output_dir=str(tmp_path), loggers=[], accelerator="cpu")
    lists = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(7)), 3, False)
    got = fitter.predict(model, DataLoader(data, batch_size=None, sampler=lists))
    assert got.predictions.tolist() == want.tolist() and got.labels.tolist() == data.y.tolist()
    assert got.metrics["predict/loss"] == pytest.approx(model.loss(model(data[list(range(7))]), data[list(range(7))]).item())

    class Batches(torch.utils.data.Dataset):  # ready-made batches of 2, read in a shuffled order
        def __len__(self):
            return 4

        def __getitem__(self, k):
            return data[list(range(2 * k, min(2 * k + 2, 7)))]

    shuffled = DataLoader(Batches(), batch_size=None, shuffle=True)
    assert fitter.predict(model, shuffled).predictions.tolist() == want.tolist()

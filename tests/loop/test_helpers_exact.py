"""OOM retry, seeding, buffers, batch helpers, TaskModule defaults, the HF/torchmetrics interop and the
search pinned to exact values where the older tests left them open (mutation round 12, auditor BN)."""

from __future__ import annotations

import collections.abc
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.module import CheckpointTally

sys.path.insert(0, str(Path(ll.__file__).resolve().parents[1] / "tests"))
from helpers import Classifier, DictDataset  # noqa: E402

QUIET = {"loggers": [], "log_level": "warning", "model_summary": False, "progress_bar": False}


# -- utils/oom.py ----------------------------------------------------------------------------------
def test_the_cpu_allocator_s_error_counts_as_out_of_memory():
    """The CPU allocator raises a plain RuntimeError; its text is what marks it (as HF matches it)."""
    from lightlike.utils.oom import is_out_of_memory

    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                                         "can't allocate memory: you tried to allocate 123 bytes."))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


class AlwaysOOM(Classifier):
    """Out of memory at every batch size; a guard ends an endless retry loop with another error."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def forward(self, batch):
        self.sizes.append(len(batch["x"]))
        if len(self.sizes) > 6:
            raise AssertionError(f"retried too often: {self.sizes}")
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_out_of_memory_at_batch_size_one_is_raised_not_retried(tmp_path):
    module = AlwaysOOM()
    fitter = ll.Fitter(max_steps=2, batch_size=4, auto_find_batch_size=True, shuffle=False,
                       output_dir=str(tmp_path), **QUIET)
    with pytest.raises(torch.OutOfMemoryError):
        fitter.fit(module, DictDataset(n=16))
    assert module.sizes == [4, 2, 1]
    assert (fitter.config.batch_size, fitter.config.grad_accum_steps) == (1, 4)


# -- utils/batches.py ------------------------------------------------------------------------------
class Frozen(collections.abc.Mapping):
    """A read-only mapping built from a dict (not a dict subclass)."""

    def __init__(self, d):
        self._d = dict(d)

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def test_another_mapping_is_rebuilt_as_its_own_type():
    from lightlike.utils.batches import map_tensors

    out = map_tensors(Frozen({"x": torch.ones(2), "n": 3}), lambda t: t * 2)
    assert type(out) is Frozen
    assert torch.equal(out["x"], torch.full((2,), 2.0)) and out["n"] == 3


def test_an_unset_init_false_field_stays_unset():
    from lightlike.utils.batches import map_tensors

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        cache: torch.Tensor = dataclasses.field(init=False)  # no default, never set

    out = map_tensors(Batch(torch.ones(2)), lambda t: t * 3)
    assert type(out) is Batch and torch.equal(out.x, torch.full((2,), 3.0))
    assert not hasattr(out, "cache")


class OOMAfter(Classifier):
    """Out of memory for micro-batches larger than ``limit`` from its ``after``-th forward on."""

    def __init__(self, limit, after):
        super().__init__()
        self.limit, self.after, self.sizes = limit, after, []

    def forward(self, batch):
        self.sizes.append(len(batch["x"]))
        if len(self.sizes) > self.after and len(batch["x"]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().forward(batch)


class SeenSaves(ll.Callback):
    def __init__(self):
        self.saves = []

    def on_save(self, fitter, state, control, path):
        self.saves.append((Path(path).name, fitter.config.batch_size))


def test_an_asynchronous_save_of_the_failed_try_lands_before_the_retry(tmp_path):
    """The failed try's checkpoint-2 (async, still in flight at the out-of-memory error) is
    committed (on_save) before the retry starts; without that its temp folder was left behind."""
    seen = SeenSaves()
    torch.manual_seed(0)
    fitter = ll.Fitter(max_steps=4, batch_size=32, save_every=2, async_save=True, auto_find_batch_size=True,
                       shuffle=False, output_dir=str(tmp_path), callbacks=[seen], **QUIET)
    fitter.fit(OOMAfter(limit=8, after=2), DictDataset(n=48))
    assert seen.saves == [("checkpoint-2", 32), ("checkpoint-2", 8), ("checkpoint-4", 8)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]


def test_tensors_set_outside_the_fields_are_mapped_too():
    from lightlike.utils.batches import map_tensors

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

        def __post_init__(self):
            self.doubled = self.x * 2  # an attribute, not a field

    out = map_tensors(Batch(torch.ones(2)), lambda t: t.to(torch.float64))
    assert out.x.dtype == out.doubled.dtype == torch.float64
    assert torch.equal(out.doubled, torch.full((2,), 2.0, dtype=torch.float64))


# -- utils/seed.py ---------------------------------------------------------------------------------
@pytest.fixture
def torch_switches():
    import os

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.benchmark = before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


def _switches():
    import os

    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def test_deterministic_mode_restores_every_switch_as_it_was(torch_switches, monkeypatch):
    from lightlike.utils.seed import deterministic_mode

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    with deterministic_mode(False):
        assert _switches() == (False, False, True, None)  # not enabled: nothing touched
    with deterministic_mode(True):
        assert _switches() == (True, False, False, ":4096:8")
    assert _switches() == (False, False, True, None)
    # a user's warn_only mode and workspace setting are theirs, inside and after
    torch.use_deterministic_algorithms(True, warn_only=True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_mode(True):
        assert _switches() == (True, False, False, ":16:8")
    assert _switches() == (True, True, True, ":16:8")


def test_seed_everything_seeds_every_generator(torch_switches):
    import random

    import numpy as np

    from lightlike.utils.seed import seed_everything

    torch.use_deterministic_algorithms(False)
    seed_everything(2**32 + 7)
    assert random.random() == random.Random(2**32 + 7).random()
    assert np.random.rand() == np.random.RandomState(7).rand()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(2**32 + 7)))
    assert not torch.are_deterministic_algorithms_enabled()
    seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark


def test_rng_kept_puts_every_stream_back_also_after_an_error():
    import random

    import numpy as np

    from lightlike.utils.seed import rng_kept

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
    with pytest.raises(KeyError), rng_kept():
        random.random(), np.random.rand(), torch.rand(1)
        raise KeyError("x")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


# -- module.py -------------------------------------------------------------------------------------
def test_labels_are_looked_up_in_their_documented_order():
    m = ll.TaskModule()
    assert m.labels({"y": 1, "labels": 2}) == 2
    assert m.labels({"target": 1, "label": 2, "y": 3}) == 2
    assert m.labels({"targets": 1, "target": 2}) == 2
    assert m.labels({"x": 1}) is None and m.labels((1, 2)) is None


@pytest.mark.parametrize(("batch", "items"), [
    ({"n": torch.tensor(3), "x": torch.zeros(4, 2)}, 4),               # a 0-d first field tells nothing
    (torch.tensor(5.0), 1),                                           # a 0-d batch is one item
    ({"seqs": [torch.zeros(5)] * 3, "a": torch.zeros(3), "b": torch.zeros(5)}, 3),  # the list's length wins
    ([{"x": torch.zeros(4)}], 4),                                     # one mapping: read as fields
    ([(torch.zeros(4), torch.zeros(4), torch.zeros(4)), (torch.zeros(4),)], 3),  # tuples of other lengths
])
def test_default_item_count_edge_cases(batch, items):
    assert ll.TaskModule().num_items(batch) == items


def test_load_weights_refuses_a_sharded_checkpoint_and_a_file_its_manifest_does_not_list(tmp_path):
    import shutil

    ll.Fitter(max_steps=1, save_every=1, batch_size=4, output_dir=str(tmp_path / "run"), **QUIET).fit(
        Classifier(), DictDataset(n=4))
    ckpt = tmp_path / "run" / "checkpoint-1"
    shutil.copy(ckpt / "model.safetensors", ckpt / "extra.safetensors")
    with pytest.raises(ll.CheckpointError, match="extra.safetensors is not listed in its manifest.json"):
        Classifier().load_weights(ckpt / "extra.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(ckpt / "manifest.json", sharded / "manifest.json")
    with pytest.raises(ll.CheckpointError, match="is a sharded checkpoint: consolidate it first"):
        Classifier().load_weights(sharded)


class Kw(ll.TaskModule):
    def __init__(self, a, b=2, **extra):
        super().__init__()
        self.save_hyperparameters(tag="t")


def test_save_hyperparameters_records_keyword_extras_and_its_own_arguments():
    assert Kw(1, c=3).hparams == {"a": 1, "b": 2, "c": 3, "tag": "t"}


# -- interop/hf.py (a stand-in model: no transformers needed) ---------------------------------------
class FixedLogits(nn.Module):
    """Returns the given logits; records the keyword arguments it was called with."""

    def __init__(self, logits):
        super().__init__()
        self.logits, self.calls = logits, []
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, **kwargs):
        self.calls.append(sorted(kwargs))
        return type("Out", (), {"logits": self.logits + 0 * self.dummy})()


def test_hf_loss_and_accuracy_count_only_labelled_tokens():
    from lightlike.interop.hf import HFCausalLM

    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5], [1 / 3] * 3]]))
    module = HFCausalLM(FixedLogits(logits), ignore_index=-1)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.tensor([[9, 1, -1, 0]]),
             "attention_mask": torch.ones(1, 4, dtype=torch.long), "other": torch.ones(1)}
    out = module(batch)
    assert module.model.calls == [["attention_mask", "use_cache"]]
    # targets 1 (from position 0, p=0.25) and 0 (from position 2, p=0.25); -1 is not counted
    torch.testing.assert_close(module.loss(out, batch), torch.tensor(-torch.log(torch.tensor(0.25)).item()))
    assert int(module.num_items(batch)) == 2
    assert module.metrics(out, batch)["accuracy"].item() == 0.0
    batch["labels"] = torch.tensor([[9, 0, -1, 2]])  # position 0 predicts 0 (argmax), position 2 predicts 2
    assert module.metrics(out, batch)["accuracy"].item() == 1.0
    # an ignore_index that is also a class id: an ignored position the model "predicts" is no hit
    same_as_class = HFCausalLM(FixedLogits(logits), ignore_index=2)
    batch2 = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.tensor([[9, 0, 1, 2]])}
    assert same_as_class.metrics(out, batch2)["accuracy"].item() == 1.0  # 2 hits of 2 counted
    # nothing labelled: loss 0 (weight 0), not 0/0
    batch["labels"] = torch.full((1, 4), -1)
    assert module.loss(out, batch).item() == 0.0 and int(module.num_items(batch)) == 0


def test_hf_loss_of_half_logits_is_computed_in_float32():
    from lightlike.interop.hf import HFCausalLM

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 50, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 5), generator=g)
    module = HFCausalLM(FixedLogits(logits))
    loss = module.loss(logits, {"input_ids": ids})
    want = nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 50), ids[:, 1:].reshape(-1))
    assert loss.dtype == torch.float32 and loss.item() == want.item()


# -- interop/metrics.py ----------------------------------------------------------------------------
def test_torchmetrics_get_the_module_s_predictions_under_the_collection_s_keys_each_evaluation(tmp_path):
    pytest.importorskip("torchmetrics")
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy

    from lightlike.interop.metrics import TorchMetric

    class Shifted(Classifier):
        """predictions() is not the forward's output: the class after the argmax."""

        def __init__(self):
            super().__init__()
            self.held = MulticlassAccuracy(num_classes=3, average="micro")
            self.wrapped = TorchMetric(MulticlassAccuracy(num_classes=3, average="micro"))  # bound by the Fitter
            self.both = MetricCollection({"acc": MulticlassAccuracy(num_classes=3, average="micro"),
                                          "macro": MulticlassAccuracy(num_classes=3, average="macro")}, prefix="c_")

        def predictions(self, outputs, batch):
            return (outputs.argmax(-1) + 1) % 3

        def streaming_metrics(self):
            return {"held": self.held, "wrapped": self.wrapped, "both": self.both}

    torch.manual_seed(0)
    module, data, other = Shifted(), DictDataset(n=10, seed=3), DictDataset(n=5, seed=9)

    def hand(d):
        with torch.no_grad():
            pred = (module({"x": d.x}).argmax(-1) + 1) % 3
        return (pred == d.y).double().mean().item()

    want = hand(data)
    fitter = ll.Fitter(max_steps=1, eval_batch_size=4, output_dir=str(tmp_path), **QUIET)
    assert fitter.validate(module, other)["val/held"] == pytest.approx(hand(other), abs=1e-6)
    first = fitter.validate(module, data)  # the held metrics start afresh: not mixed with `other`
    second = fitter.validate(module, data)
    assert first == second
    assert sorted(first) == ["val/accuracy", "val/c_acc", "val/c_macro", "val/held", "val/loss", "val/wrapped"]
    assert first["val/held"] == first["val/wrapped"] == first["val/c_acc"] == pytest.approx(want, abs=1e-6)
    assert first["val/held"] != pytest.approx(first["val/accuracy"], abs=1e-6)  # not the forward's argmax


# -- search.py -------------------------------------------------------------------------------------
def _search_fitter(out, **kw):
    return ll.Fitter(max_steps=1, eval_every=1, batch_size=8, output_dir=str(out), seed=0, **QUIET, **kw)


def test_search_refuses_bad_arguments_before_any_trial(tmp_path):
    optuna = pytest.importorskip("optuna")
    fitter = _search_fitter(tmp_path / "s")
    with pytest.raises(ll.ConfigError, match="n_trials must be a positive int, got 0"):
        fitter.search(Classifier, {"width": [4]}, 0, train=DictDataset(8), val=DictDataset(8))
    with pytest.raises(ll.ConfigError, match="search needs evaluation data"):
        fitter.search(Classifier, {"width": [4]}, 1, train=DictDataset(8))
    study = optuna.create_study()
    with pytest.raises(ll.ConfigError, match="'widht' .* are neither FitConfig fields"):
        fitter.search(Classifier, {"widht": [4]}, 1, train=DictDataset(8), val=DictDataset(8), study=study)
    assert study.trials == []  # a dict space's names are checked before the study runs a trial
    assert not (tmp_path / "s" / "trial-0").exists()


def test_search_takes_the_given_sampler_explicit_val_and_any_name_for_a_kwargs_factory(tmp_path):
    optuna = pytest.importorskip("optuna")
    from optuna.distributions import FloatDistribution

    class OwnData(Classifier):
        def train_data(self):
            return DictDataset(8)

        def val_data(self):
            raise AssertionError("val= was given: val_data() must not be called")

    def factory(**kw):
        assert kw == {"anything": 7}
        return OwnData()

    study = _search_fitter(tmp_path / "s").search(
        factory, {"learning_rate": FloatDistribution(1e-3, 1e-1), "anything": [7]}, 1, val=DictDataset(4, seed=1),
        sampler=optuna.samplers.GridSampler({"learning_rate": [0.0123], "anything": [7]}))
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert trial.params == {"learning_rate": 0.0123, "anything": 7}


def test_search_timeout_ends_it_after_the_running_trial(tmp_path):
    pytest.importorskip("optuna")
    import time

    def slow(width=4):
        time.sleep(0.3)
        return Classifier(width=width)

    study = _search_fitter(tmp_path / "s").search(slow, {"width": [4, 8]}, 3, train=DictDataset(8),
                                                  val=DictDataset(4, seed=1), timeout=0.2)
    assert len(study.trials) == 1


def test_a_callback_that_cannot_be_copied_is_used_as_it_is(tmp_path):
    pytest.importorskip("optuna")
    import threading

    class Locked(ll.Callback):
        def __init__(self):
            self.lock, self.fits = threading.Lock(), 0  # a lock cannot be deep-copied

        def on_fit_start(self, fitter, state, control):
            self.fits += 1

    cb = Locked()
    _search_fitter(tmp_path / "s", callbacks=[cb]).search(Classifier, {"width": [4]}, 2, train=DictDataset(8),
                                                         val=DictDataset(4, seed=1))
    assert cb.fits == 2


def test_a_signal_between_trials_stops_the_search_before_the_next_fit(tmp_path):
    pytest.importorskip("optuna")
    import os
    import signal

    from lightlike.preemption import Preempted

    class Counted(Classifier):
        def forward(self, batch):
            self.forwards += 1
            return super().forward(batch)

    built = []

    def factory(width=4):
        built.append(Counted(width=width))
        built[-1].forwards = 0
        if len(built) == 2:  # after trial 0's fit, before trial 1's
            os.kill(os.getpid(), signal.SIGTERM)
        return built[-1]

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted, match=r"preempted by SIGTERM; .*exit code 75"):
        _search_fitter(tmp_path / "s").search(factory, {"width": [4]}, 3, train=DictDataset(8),
                                              val=DictDataset(4, seed=1))
    assert len(built) == 2 and built[0].forwards > 0 and built[1].forwards == 0
    assert signal.getsignal(signal.SIGTERM) == before


# -- utils/buffers.py: activation checkpointing's recompute leaves buffers as one forward left them ---
class Counting(nn.Module):
    """Counts its training forwards in a buffer (an in-place update that moves the version counter)
    and normalises with BatchNorm (whose kernel does not move it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.calls.add_(1)
        return self.bn(self.lin(x))


def test_checkpointed_forward_updates_buffers_once():
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    plain = Counting()
    wrapped = ll.TaskModule()
    wrapped.sub = Counting()
    wrapped.sub.load_state_dict(plain.state_dict())
    wrapped.gradient_checkpointing_enable()
    plain(x).sum().backward()
    tally = CheckpointTally()
    tally.start()
    try:
        wrapped.maybe_checkpoint(wrapped.sub, x).sum().backward()
    finally:
        tally.stop()
    assert tally.calls == 1 and wrapped.gradient_checkpointing
    assert "_checkpointed" not in wrapped.__dict__  # nothing written onto the module for the check
    assert int(wrapped.sub.calls) == int(plain.calls) == 1
    assert int(wrapped.sub.bn.num_batches_tracked) == 1
    assert torch.equal(wrapped.sub.bn.running_mean, plain.bn.running_mean)
    assert torch.equal(wrapped.sub.bn.running_var, plain.bn.running_var)
    torch.testing.assert_close(wrapped.sub.lin.weight.grad, plain.lin.weight.grad, rtol=0, atol=0)


def test_a_search_metric_the_fit_does_not_report_is_named(tmp_path):
    pytest.importorskip("optuna")
    with pytest.raises(ll.ConfigError, match=r"search metric 'val/nope' is not among the evaluation metrics "
                                             r"\['val/accuracy', 'val/loss'\]"):
        _search_fitter(tmp_path / "a").search(Classifier, {"width": [4]}, 1, train=DictDataset(8),
                                              val=DictDataset(4, seed=1), metric="val/nope")


def test_hf_without_labels_padding_is_no_target_and_checkpointing_switches_only_on_change():
    from lightlike.interop.hf import HFCausalLM

    class Switchable(FixedLogits):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.calls.append(("enable", gradient_checkpointing_kwargs))

        def gradient_checkpointing_disable(self):
            self.calls.append(("disable",))

    module = HFCausalLM(Switchable(torch.zeros(1, 4, 3)))
    # right padding: the target after the last real token is padding, not a target
    batch = {"input_ids": torch.tensor([[5, 6, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 0, 0]])}
    assert module.shifted_labels(batch).tolist() == [[6, -100, -100]] and int(module.num_items(batch)) == 1
    module.gradient_checkpointing_disable()  # as the Fitter calls it: already off, nothing called
    module.gradient_checkpointing_enable()
    module.gradient_checkpointing_enable()
    module.gradient_checkpointing = False  # as a strategy that checkpoints the blocks itself sets it
    assert not module.gradient_checkpointing
    assert module.model.calls == [("enable", {"use_reentrant": False}), ("disable",)]


def test_torchmetric_refuses_a_local_only_metric_and_a_batch_without_labels():
    pytest.importorskip("torchmetrics")
    from torchmetrics.classification import MulticlassAccuracy

    from lightlike.errors import ModuleContractError
    from lightlike.interop.metrics import TorchMetric

    with pytest.raises(ModuleContractError, match=r"sync_on_compute=False\) would report each process's own share"):
        TorchMetric(MulticlassAccuracy(num_classes=3, sync_on_compute=False))
    metric = TorchMetric(MulticlassAccuracy(num_classes=3))
    with pytest.raises(ModuleContractError, match="cannot update MulticlassAccuracy: the batch has no labels"):
        metric.update(torch.zeros(2, 3), {"x": torch.zeros(2, 8)})

"""Bad input that used to surface as a raw traceback, a silent no-op or a wrong choice: one clear
message each, and what is already done is kept (issue 32)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from helpers import Classifier, DictDataset
from torch import nn
from torch.utils.data import DataLoader

import lightlike as ll
from lightlike.best import greater_is_better
from lightlike.checkpoint import verify_checkpoint
from lightlike.state import FitState


def fitter(tmp_path, **kw):
    cfg = dict(max_steps=2, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False)
    cfg.update(kw)
    return ll.Fitter(**cfg)


# -- 1: a metric_for_best the evaluation does not have --------------------------------------------
def test_metric_for_best_of_no_evaluation_set_is_refused_at_set_up(tmp_path):
    """Every evaluation metric is '<set>/<name>': a key whose set is not there is refused before
    any step, not after training up to the first evaluation (a name alone, HF's 'eval_accuracy',
    names the one metric of that name: tests/checkpoint/test_defaults.py)."""
    with pytest.raises(ll.ConfigError) as caught:
        fitter(tmp_path, metric_for_best="eval/accuracy", eval_every=2, save_every=2).fit(
            Classifier(), DictDataset(n=16), DictDataset(n=8, seed=1))
    assert str(caught.value) == ("metric_for_best='eval/accuracy' names no evaluation set of this fit: evaluation "
                                 "metrics are '<set>/<name>' with the sets ['val'] (e.g. 'val/loss')")
    assert caught.value.settings == ("metric_for_best",)
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    with pytest.raises(ll.ConfigError, match=r"with the sets \['a', 'b'\] \(e.g. 'a/loss'\) \(did you mean 'b/loss'\?\)$"):
        fitter(tmp_path, metric_for_best="bb/loss").fit(Classifier(), DictDataset(n=16),
                                                        {"a": DictDataset(n=8), "b": DictDataset(n=8)})


@pytest.mark.parametrize("async_save", [False, True])
def test_a_metric_for_best_typo_is_raised_after_the_steps_checkpoint(tmp_path, async_save):
    """The metric names of metrics() are known only at the first evaluation: the typo is raised
    there, naming the keys there are and the close one, but only once the checkpoint due at that
    step is written and committed. It verifies, and a resume with the key fixed goes on from it."""
    kw = dict(max_steps=4, eval_every=2, save_every=2, async_save=async_save)
    with pytest.raises(ll.ConfigError) as caught:
        fitter(tmp_path, metric_for_best="val/acuracy", **kw).fit(Classifier(), DictDataset(n=16),
                                                                  DictDataset(n=8, seed=1))
    assert str(caught.value) == (
        "metric_for_best='val/acuracy' is not among the evaluation metrics ['val/accuracy', 'val/loss'] (did you "
        "mean 'val/accuracy'?): set metric_for_best to one of them (found at the evaluation of step 2; "
        "checkpoint-2 was saved first)")
    ckpt = tmp_path / "run" / "checkpoint-2"
    verify_checkpoint(ckpt, hashes=True)
    assert not (tmp_path / "run" / "checkpoint-4").exists()
    saved = FitState.saved_in(ckpt)
    assert saved.global_step == 2 and saved.last_eval_step == 2
    result = fitter(tmp_path, metric_for_best="val/accuracy", **kw).fit(
        Classifier(), DictDataset(n=16), DictDataset(n=8, seed=1), resume=True)
    assert result.global_step == 4 and result.best_checkpoint is not None


def test_a_metric_for_best_typo_without_a_checkpoint_due_says_so(tmp_path):
    with pytest.raises(ll.ConfigError, match=r"\(found at the evaluation of step 2; no checkpoint was due at this "
                                             r"step\)$"):
        fitter(tmp_path, max_steps=4, eval_every=2, metric_for_best="val/los").fit(
            Classifier(), DictDataset(n=16), DictDataset(n=8, seed=1))


# -- 2: eval_every past the last step -------------------------------------------------------------
@pytest.mark.parametrize("kw, steps, evaluated", [
    (dict(max_steps=3, eval_every=5), 3, [3]),
    (dict(max_steps=None, max_epochs=2, eval_every=9, eval_on_epoch_end=True), 4, [2, 4]),  # 16 items / 8
])
def test_eval_every_larger_than_the_run_warns_at_set_up(tmp_path, caplog, kw, steps, evaluated):
    """HF never evaluates then, silently; lightlike evaluates at the last step anyway (and at
    epoch ends if asked), and says at set-up that no eval_every step comes."""
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        result = fitter(tmp_path, **{"batch_size": 8, **kw}).fit(Classifier(), DictDataset(n=16),
                                                                 DictDataset(n=8, seed=1))
    when = "at epoch ends and at the last step (4)" if kw.get("eval_on_epoch_end") else "once, at the last step (3)"
    every = kw["eval_every"]
    assert [r.getMessage() for r in caplog.records if "eval_every" in r.getMessage()] == [
        f"eval_every={every} is larger than this run's {steps} optimizer steps: no evaluation falls on an eval_every "
        f"step, so the run is evaluated only {when}. Set eval_every to at most {steps} to evaluate during training"]
    assert [h["step"] for h in result.state.log_history if "val/loss" in h] == evaluated


def test_eval_every_within_the_run_does_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fitter(tmp_path, max_steps=3, eval_every=3).fit(Classifier(), DictDataset(n=16), DictDataset(n=8, seed=1))
    assert "eval_every" not in caplog.text


# -- 3: the direction of metric_for_best ------------------------------------------------------------
class Scripted(Classifier):
    """metrics() gives ``{name: VALUES[k]}`` at the k-th evaluation (one batch per evaluation)."""

    VALUES = (0.5, 0.25, 0.375)

    def __init__(self, name):
        super().__init__()
        self.name, self.calls = name, 0

    def metrics(self, outputs, batch):
        self.calls += 1
        return {self.name: torch.tensor(self.VALUES[self.calls - 1])}


@pytest.mark.parametrize("name, setting, best_step", [
    ("error_rate", None, 4), ("top1-err", None, 4), ("perplexity", None, 4), ("nll_loss", None, 4),
    ("wer", None, 4), ("accuracy", None, 2), ("f1", None, 2), ("error_rate", True, 2), ("accuracy", False, 4),
])
def test_the_best_checkpoint_follows_the_direction_of_the_metrics_name(tmp_path, name, setting, best_step):
    """Evaluations at steps 2, 4, 6 give 0.5, 0.25, 0.375: a lower-is-better name picks step 4,
    a higher-is-better one step 2 (val/error_rate was taken as higher-is-better: step 2)."""
    result = fitter(tmp_path, max_steps=6, eval_every=2, save_every=2, metric_for_best=f"val/{name}",
                    greater_is_better=setting, eval_batch_size=8).fit(Scripted(name), DictDataset(n=16),
                                                                      DictDataset(n=8, seed=1))
    assert result.state.best_step == best_step
    assert result.state.best_metric == Scripted.VALUES[best_step // 2 - 1]
    assert result.best_checkpoint == str(tmp_path / "run" / f"checkpoint-{best_step}")


def test_direction_rule_by_name():
    lower = ["val/loss", "val/eval_loss", "val/celoss", "val/EvalLoss", "val/error", "val/error_rate", "val/word_errors", "val/top5-err",
             "val/ppl", "val/perplexity", "val/cer", "val/mse", "val/RMSE", "val/mae", "val/nll"]
    higher = ["val/accuracy", "val/f1", "val/bleu", "val/auc", "val/terror_index", "val/precision"]
    assert [m for m in lower if greater_is_better(m, None)] == []
    assert [m for m in higher if not greater_is_better(m, None)] == []


# -- 4: items torch's default collate cannot join, and a __len__ that says too much ----------------
class Odd(DictDataset):
    """Item 5 is changed by ``how``; ``length`` is what __len__ says."""

    def __init__(self, how, length=None):
        super().__init__(n=16)
        self.how, self.length = how, length

    def __len__(self):
        return self.length or super().__len__()

    def __getitem__(self, i):
        item = super().__getitem__(i)
        if i == 5 and self.how == "missing":
            del item["w"]
        elif i == 5 and self.how == "extra":
            item["z"] = torch.tensor(1)
        elif i == 5 and self.how == "shape":
            item["x"] = item["x"][:7]
        elif i == 5 and self.how == "kind":
            item["y"] = [1]
        return item


TAIL = (". torch's default collate needs the same keys, lengths and shapes in every item: make them so, or pass a "
        "DataLoader with a collate_fn of your own (lightlike.data.PaddingCollator pads variable lengths)")


@pytest.mark.parametrize("how, problem", [
    ("missing", "dataset[0] has keys ['w', 'x', 'y'] but dataset[5] has keys ['x', 'y'] (missing ['w'])"),
    ("extra", "dataset[0] has keys ['w', 'x', 'y'] but dataset[5] has keys ['w', 'x', 'y', 'z'] (extra ['z'])"),
    ("shape", "dataset[0]['x'] has shape (8,) but dataset[5]['x'] has shape (7,)"),
    ("kind", "dataset[0]['y'] is a Tensor but dataset[5]['y'] is a list"),
])
def test_items_that_cannot_be_collated_are_named(tmp_path, how, problem):
    """torch raised KeyError: 'w', 'stack expects each tensor to be equal size', or (an extra
    key) dropped the key without a word. Training data and evaluation data alike."""
    with pytest.raises(ll.DataError) as caught:
        fitter(tmp_path, batch_size=8, shuffle=False).fit(Classifier(), Odd(how))
    assert str(caught.value) == f"the training items of one batch cannot be collated: {problem}{TAIL}"
    with pytest.raises(ll.DataError) as caught:
        fitter(tmp_path, batch_size=8).validate(Classifier(), Odd(how))
    assert str(caught.value) == f"the val items of one batch cannot be collated: {problem}{TAIL}"


def test_a_len_larger_than_the_dataset_names_the_index(tmp_path):
    """16 items, __len__ says 20: torch raised the IndexError of the tensor __getitem__ indexes."""
    with pytest.raises(ll.DataError) as caught:
        fitter(tmp_path, batch_size=8, shuffle=False, max_steps=3).fit(Classifier(), Odd(None, length=20))
    assert str(caught.value) == (
        "the training dataset's __len__() says 20 items, but dataset[16] raised IndexError: index 16 is out of "
        "bounds for dimension 0 with size 16. Make __len__ return the number of items __getitem__ serves "
        "(indices 0 to 19)")
    assert isinstance(caught.value.__cause__, IndexError)


class Texts(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return f"text {i}"


class SeesTexts(Classifier):
    """Records the batches it gets: a batch of strings, as torch's default collate gives it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        self.seen.append(batch)
        return self.net(torch.ones(len(batch), 8))

    def loss(self, outputs, batch):
        return outputs.sum() * 0.0 + outputs.mean()

    def num_items(self, batch):
        return len(batch)


def test_a_batch_of_strings_is_a_plain_list(tmp_path):
    """torch's default collate returns a batch of strings as the list of items it was given;
    lightlike's reads must not leak their own list type (the items with their indices) into it."""
    module = SeesTexts()
    fitter(tmp_path, batch_size=4, shuffle=False, max_steps=2).fit(module, Texts())
    assert [type(b) for b in module.seen] == [list, list]
    assert module.seen == [[f"text {i}" for i in range(4)], [f"text {i}" for i in range(4, 8)]]


# -- 5: forward() returning None ---------------------------------------------------------------
class ReturnsNothing(Classifier):
    def forward(self, batch):
        self.net(batch["x"])  # the return forgotten

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs["logits"], batch["y"])


def test_forward_returning_none_is_named_at_the_call(tmp_path):
    with pytest.raises(ll.ModuleContractError) as caught:
        fitter(tmp_path).fit(ReturnsNothing(), DictDataset(n=16))
    assert str(caught.value) == (
        "forward() returned None at step 1, micro-batch 0, and loss() failed on it (TypeError: 'NoneType' object "
        "is not subscriptable): return the outputs loss() reads (e.g. the logits, or the model's output object) "
        "from forward()")
    with pytest.raises(ll.ModuleContractError, match=r"^forward\(\) returned None in val batch 0, and loss\(\) "):
        fitter(tmp_path).validate(ReturnsNothing(), DictDataset(n=8))


# -- 6: lazily initialised modules ----------------------------------------------------------------
class Lazy(Classifier):
    """LazyLinear, then BatchNorm and dropout (random draws after the lazy layer)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))


def test_lazy_modules_are_materialised_as_a_hand_written_loop_does(tmp_path):
    """A hand-written loop whose first training forward pass materialises the LazyLinear (its
    initial values drawn from the seeded stream, then BatchNorm's statistics and dropout): the
    same weights, running statistics and losses, bit for bit. (It failed deep in the optimizer's
    set-up: "Can't access the shape of an uninitialized parameter".)"""
    data = DictDataset(n=16)
    torch.manual_seed(1)
    ours = Lazy()
    torch.manual_seed(1)
    ref = Lazy()
    result = fitter(tmp_path, max_steps=4, batch_size=4, shuffle=False, optimizer="sgd", learning_rate=0.1,
                    lr_scheduler="constant", seed=7, log_every=1).fit(ours, data)

    torch.manual_seed(7)
    optimizer, losses = None, []
    for batch in DataLoader(data, batch_size=4, generator=torch.Generator()):  # (draws nothing from torch's)
        loss = ref.loss(ref(batch), batch)
        if optimizer is None:  # materialised by the first forward pass
            optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert result.global_step == 4
    assert type(ours.net[0]) is nn.Linear and ours.net[0].weight.shape == (16, 8)
    want = ref.state_dict()
    assert sorted(ours.state_dict()) == sorted(want)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert [h["train/loss"] for h in result.state.log_history if "train/loss" in h] == pytest.approx(losses, abs=0)


def test_lazy_modules_without_a_first_item_to_read_are_refused_by_name(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(DictDataset(n=8)[i] for i in range(8))

    with pytest.raises(ll.ModuleContractError) as caught:
        fitter(tmp_path).fit(Lazy(), Stream())
    assert str(caught.value) == (
        "['net.0'] have parameters that are not initialised yet (lazy modules), and the training data's first item "
        "cannot be read alone to initialise them: run one forward pass before fit() (with torch.no_grad(): "
        "module(batch)), or give the layers their input sizes (nn.Linear(in_features, ...) for nn.LazyLinear)")


def test_lazy_modules_with_auto_find_batch_size_are_refused_by_name(tmp_path):
    """A retry starts from the module's first weights, which a lazy module does not have yet
    (torch raised "Attempted to use an uninitialized parameter" from the copy)."""
    with pytest.raises(ll.ModuleContractError, match=re.escape(
            "auto_find_batch_size=True keeps the module's first weights for a retry, but ['net.0'] have parameters "
            "that are not initialised yet (lazy modules): run one forward pass before fit()")):
        fitter(tmp_path, auto_find_batch_size=True).fit(Lazy(), DictDataset(n=16))


# -- 7: a loss that reaches no parameter --------------------------------------------------------------
class Unregistered(Classifier):
    """Its layers sit in a plain list (not registered); the registered ``net`` is never used."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(8, 3)]

    def forward(self, batch):
        return self.layers[0](batch["x"])


def test_a_loss_that_reaches_no_parameter_warns_once(tmp_path, caplog):
    module = Unregistered()
    before = [p.detach().clone() for p in module.parameters()]
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fitter(tmp_path, max_steps=3).fit(module, DictDataset(n=16))
    assert [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()] == [
        "no gradient reached any of the optimizer's 4 trainable parameters at step 1: the loss is not connected to "
        "them, so training changes nothing. Compute loss() from forward()'s outputs without .detach(), with layers "
        "the module registers (in a plain list or dict they are not: use nn.ModuleList or nn.ModuleDict)"]
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # nothing trained


def test_a_loss_that_reaches_the_parameters_does_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fitter(tmp_path, max_steps=2).fit(Classifier(), DictDataset(n=16))
    assert "no gradient" not in caplog.text


# -- 8: seeds whose random streams repeat another seed's ----------------------------------------------
@pytest.mark.parametrize("seed, same_as", [(-(2**63), 0), (2**32, 0), (-1, 2**32 - 1), (2**63 - 1, 2**32 - 1)])
def test_seeds_that_repeat_another_seeds_streams_are_refused(seed, same_as):
    """torch keeps the low 32 bits of a seed: these seeds drew the same numbers as ``same_as``
    (seed=-(2**63) trained exactly like seed=0). Refused, naming the seed they repeat."""
    torch.manual_seed(seed)
    first = torch.rand(4)
    torch.manual_seed(same_as)
    assert torch.equal(first, torch.rand(4))  # the collision the range rules out
    with pytest.raises(ll.ConfigError) as caught:
        ll.FitConfig(max_steps=1, seed=seed)
    assert str(caught.value) == (
        "seed must be in [0, 2**32 - 1]: torch's and numpy's generators keep only the low 32 bits of a seed and "
        "Python's ignores its sign, so a seed outside that range gives the random streams of one inside it "
        f"(seed={seed} draws torch's and numpy's streams of seed={same_as}); got {seed}")
    assert caught.value.settings == ("seed",)
    assert ll.FitConfig(max_steps=1, seed=same_as).seed == same_as


def test_seed_range_gives_distinct_streams_at_its_ends():
    streams = []
    for seed in (0, 1, 2**31, 2**32 - 1):
        torch.manual_seed(seed)
        streams.append(tuple(torch.rand(4).tolist()))
    assert len(set(streams)) == 4
    assert re.search(r"0 to 2\*\*32 - 1", ll.FitConfig.help()["seed"])


class RowRegressor(ll.TaskModule):
    """A module whose batch is a tensor of rows (``by_key``: one that reads ``batch["x"]``)."""

    def __init__(self, by_key=False):
        super().__init__()
        self.by_key = by_key
        self.lin = nn.Linear(4, 1)

    def forward(self, batch):
        return self.lin(batch["x"] if self.by_key else batch)

    def loss(self, outputs, batch):
        return outputs.pow(2).mean()


def test_a_tensor_as_the_dataset_trains_as_its_rows_and_a_read_by_key_says_so(tmp_path):
    """``fit(module, torch.randn(64, 4))`` ended in torch's ``new(): invalid data type 'str'``. A
    tensor is a dataset of its rows: the weights equal a hand loop over its rows in batches; a
    module that reads the batch by key gets one DataError saying the batch is a tensor."""
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    module = RowRegressor()
    torch.manual_seed(0)
    hand = RowRegressor()
    fitter(tmp_path, max_steps=3, shuffle=False, optimizer="sgd", learning_rate=0.1, lr_scheduler="constant").fit(module, data)
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    for i in range(3):
        hand.loss(hand(data[4 * i:4 * i + 4]), None).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), hand.parameters(), strict=True))
    with pytest.raises(ll.DataError, match=r"the module read the batch by key at step 1, micro-batch 0, but the batch "
                                           r"is a tensor of shape \(4, 4\), not a mapping"):
        fitter(tmp_path, overwrite_output_dir=True).fit(RowRegressor(by_key=True), data)


def test_a_compute_metrics_key_that_metrics_gives_too_is_warned_about(tmp_path, caplog):
    """``metrics()`` gives the per-batch ``accuracy``; ``compute_metrics`` returns its own
    ``accuracy``: it silently replaced the other. Now the reported value is still
    compute_metrics' (the HF Trainer's only source), and a warning names the key, once."""
    class Both(Classifier):
        def compute_metrics(self, predictions, labels):
            return {"accuracy": 0.25, "f1": 0.5}

    with caplog.at_level(logging.WARNING, logger="lightlike"):
        metrics = fitter(tmp_path).validate(Both(), DictDataset(n=8))
        fitter(tmp_path).validate(Both(), DictDataset(n=8))
    assert metrics["val/accuracy"] == 0.25 and metrics["val/f1"] == 0.5
    said = [r.getMessage() for r in caplog.records if "gives 'val/accuracy'" in r.getMessage()]
    assert said == ["compute_metrics() of Both gives 'val/accuracy', which loss/metrics() give too: compute_metrics()'s "
                    "value is the one reported; rename one of them to keep both"]


def test_case_slips_and_an_empty_output_dir_and_a_warmup_past_the_end_are_named(tmp_path, caplog):
    """``optimizer="AdamW"`` suggested 'adam' (the closest spelling), now the lower-case name it
    means; ``output_dir=""`` was taken (the working directory); ``warmup_steps`` not below the
    run's steps trained without a word although the rate never reaches its peak."""
    with pytest.raises(ll.ConfigError, match=r"optimizer='AdamW' is not valid \(did you mean 'adamw'\?\)"):
        ll.FitConfig(optimizer="AdamW")
    with pytest.raises(ll.ConfigError, match=r"lr_scheduler='Cosine' is not valid \(did you mean 'cosine'\?\)"):
        ll.FitConfig(lr_scheduler="Cosine")
    with pytest.raises(ll.ConfigError, match="output_dir is empty: name the directory"):
        ll.FitConfig(output_dir="")
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fitter(tmp_path, max_steps=3, warmup_steps=5).fit(Classifier(), DictDataset(n=16))
    assert "warmup_steps=5 is not below this run's 3 optimizer steps: the learning rate never reaches " \
           "learning_rate=0.001" in caplog.text

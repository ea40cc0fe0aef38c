"""Schedulers from configure_optimizers, stepped as Lightning steps them: a bare scheduler and
interval="epoch" at each epoch's end, interval="step" per optimizer step, frequency, monitor for
ReduceLROnPlateau; against a hand-written loop and exact values. Also: one name resolution for
reduce_lr_on_plateau and the best checkpoint, and max_epochs=1e18 alone."""

import logging

import pytest
import torch
from helpers import Classifier, DictDataset, StopAt

import lightlike as ll
from lightlike.lr_schedulers import Schedulers, read_configure_optimizers

STEPS_PER_EPOCH = 4  # DictDataset(16), batch_size 4


class Scheduled(Classifier):
    """SGD(lr=0.1) with the scheduler(s) ``make(opt)`` returns, in the form it returns them."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return self.make(opt)


class Rates(ll.Callback):
    """The rate each optimizer step uses."""

    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def fit(tmp_path, make, resume=None, callbacks=(), val=None, **fields):
    torch.manual_seed(0)
    module, rates = Scheduled(make), Rates()
    kw = {"max_epochs": 3, "batch_size": 4, "shuffle": False, "loggers": [], "model_summary": False,
          "output_dir": str(tmp_path), **fields}
    fitter = ll.Fitter(callbacks=[rates, *callbacks], **kw)
    try:
        fitter.fit(module, DictDataset(16), val, resume=resume)
    except KeyboardInterrupt:
        pass
    return fitter, module, rates.lrs


def hand_loop(epochs, step_per_epoch=True):
    """SGD with StepLR(step_size=1, gamma=0.1) stepped at each epoch's end (Lightning's default),
    over the batches in order: the weights and the rate of every step."""
    torch.manual_seed(0)
    module = Classifier()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    data, lrs = DictDataset(16), []
    for _ in range(epochs):
        for i in range(STEPS_PER_EPOCH):
            batch = {"x": data.x[i * 4:(i + 1) * 4], "y": data.y[i * 4:(i + 1) * 4]}
            module.loss(module(batch), batch).backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            opt.zero_grad()
        sched.step()
    return module, lrs, opt.param_groups[0]["lr"]


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)


@pytest.mark.parametrize("form", ["lists", "pair", "dict", "epoch dict"])
def test_a_bare_scheduler_steps_at_each_epochs_end_as_in_lightning(tmp_path, caplog, form):
    """([opt], [StepLR(step_size=1)]) over 3 epochs: 0.1, 0.01, 0.001 (it was stepped every
    optimizer step: 1e-13 after 12 steps); the weights are the hand-written loop's."""
    make = {"lists": lambda o: ([o], [step_lr(o)]), "pair": lambda o: (o, step_lr(o)),
            "dict": lambda o: {"optimizer": o, "lr_scheduler": step_lr(o)},
            "epoch dict": lambda o: [{"optimizer": o, "lr_scheduler": {"scheduler": step_lr(o), "interval": "epoch"}}]}
    fitter, module, lrs = fit(tmp_path, make[form])
    ref, ref_lrs, ref_last = hand_loop(3)
    assert lrs == ref_lrs == [0.1] * 4 + [pytest.approx(0.01)] * 4 + [pytest.approx(0.001)] * 4
    assert fitter.optimizer.param_groups[0]["lr"] == ref_last == pytest.approx(1e-4)
    for a, b in zip(module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    said = "configure_optimizers returned StepLR without an interval: it steps at each epoch's end"
    assert (said in caplog.text) == (form != "epoch dict")  # written out: nothing to say


def test_interval_step_with_frequency_steps_every_nth_step_of_an_epoch(tmp_path):
    """'interval': 'step', 'frequency': 3 on epochs of 4 steps: after steps 3 of each epoch
    (Lightning counts the batches of the epoch), so twice in 2 epochs."""
    def make(o):
        return {"optimizer": o, "lr_scheduler": {"scheduler": step_lr(o), "interval": "step", "frequency": 3}}

    _, _, lrs = fit(tmp_path, make, max_epochs=2)
    assert lrs == pytest.approx([0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.01, 0.001])


def test_interval_epoch_with_frequency_and_a_max_steps_that_ends_mid_epoch(tmp_path):
    def make(o):
        return [o], [{"scheduler": step_lr(o), "frequency": 2}]

    fitter, _, lrs = fit(tmp_path / "a", make, max_epochs=5)
    assert lrs == pytest.approx([0.1] * 8 + [0.01] * 8 + [0.001] * 4)  # after epochs 2 and 4
    fitter, _, lrs = fit(tmp_path / "b", lambda o: ([o], [step_lr(o)]), max_epochs=None, max_steps=6)
    assert lrs == pytest.approx([0.1] * 4 + [0.01] * 2)  # one epoch ended; the second did not
    assert fitter.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


@pytest.mark.parametrize("cut", [2, 4, 6])
def test_an_epoch_scheduler_resumes_bit_exactly(tmp_path, cut):
    """Killed after step ``cut`` (mid-epoch, at an epoch's end) and resumed: the rates and weights
    of the uninterrupted run (the epoch's end steps once, before its checkpoint)."""
    def make(o):
        return [o], [step_lr(o)]

    whole, whole_module, whole_lrs = fit(tmp_path / "whole", make, save_every=2)
    fit(tmp_path / "cut", make, save_every=2, callbacks=[StopAt(cut + 1)])  # (its checkpoint: cut's)
    resumed, module, lrs = fit(tmp_path / "cut", make, save_every=2, resume=True)
    assert resumed.resumed_from.endswith(f"checkpoint-{cut}")
    assert lrs == whole_lrs[cut:]
    for a, b in zip(whole_module.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)


class Scored(Scheduled):
    """``val/score`` is the next of ``scores`` at each evaluation."""

    def __init__(self, make, scores):
        super().__init__(make)
        self.scores, self.evaluations = list(scores), 0

    def compute_metrics(self, predictions, labels):
        self.evaluations += 1
        return {"score": self.scores[self.evaluations - 1]}


def plateau(monitor, **settings):
    def make(o):
        s = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5, threshold=0.0)
        return {"optimizer": o, "lr_scheduler": {"scheduler": s, "monitor": monitor, **settings}}
    return make


@pytest.mark.parametrize("monitor", ["val/score", "val_score", "score"])
def test_a_monitored_plateau_steps_at_each_epochs_end_with_that_evaluation(tmp_path, monitor):
    """patience 0: the score improves at the first two epochs' evaluations, stalls at the third
    and fourth: the rate halves after epoch 3 and after epoch 4."""
    torch.manual_seed(0)
    module, rates = Scored(plateau(monitor), [5, 4, 4, 4]), Rates()
    fitter = ll.Fitter(max_epochs=4, batch_size=4, eval_on_epoch_end=True, loggers=[], model_summary=False,
                       output_dir=str(tmp_path), callbacks=[rates])
    fitter.fit(module, DictDataset(16), DictDataset(4, seed=1))
    assert rates.lrs == [0.1] * 12 + [0.05] * 4
    assert fitter.optimizer.param_groups[0]["lr"] == 0.025


def test_a_monitored_epoch_plateau_resumes_with_the_value_it_was_given(tmp_path):
    """eval_every=3 on epochs of 4 steps: the epoch's end at step 4 steps with step 3's value,
    which checkpoint-3 holds; killed after it and resumed, the run is the uninterrupted one.
    (threshold 0.9: no evaluation after the first counts as better, patience 0 halves each time.)"""
    def make(o):
        s = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5, threshold=0.9)
        return {"optimizer": o, "lr_scheduler": s, "monitor": "val_loss"}

    val = DictDataset(4, seed=1)
    whole, whole_module, whole_lrs = fit(tmp_path / "whole", make, val=val, eval_every=3, save_every=3)
    assert whole_lrs == [0.1] * 8 + [0.05] * 4  # after epoch 1: the first value; after epoch 2: halved
    fit(tmp_path / "cut", make, val=val, eval_every=3, save_every=3, callbacks=[StopAt(4)])
    resumed, module, lrs = fit(tmp_path / "cut", make, val=val, eval_every=3, save_every=3, resume=True)
    assert resumed.resumed_from.endswith("checkpoint-3") and lrs == whole_lrs[3:]
    assert resumed.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"] == 0.025
    for a, b in zip(whole_module.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_monitored_step_interval_plateau_steps_after_each_evaluation(tmp_path):
    """interval="step": stepped after every evaluation (eval_every=2) with its value; frequency 2:
    after every second one. patience 0 halves the rate at each stalled evaluation it is given."""
    def run(name, frequency):
        torch.manual_seed(0)
        module, rates = Scored(plateau("val_score", interval="step", frequency=frequency), [5, 4, 4, 4]), Rates()
        fitter = ll.Fitter(max_steps=8, batch_size=4, eval_every=2, loggers=[], model_summary=False,
                           output_dir=str(tmp_path / name), callbacks=[rates])
        fitter.fit(module, DictDataset(32), DictDataset(4, seed=1))
        return rates.lrs

    assert run("every", 1) == [0.1] * 6 + [0.05] * 2  # stalls at steps 6 and 8's evaluations
    assert run("second", 2) == [0.1] * 8  # given the evaluations of steps 4 (4) and 8 (4): one stall, after the end


def test_a_scheduler_state_of_one_scheduler_alone_loads():
    """A checkpoint holding one scheduler's own state (written before the counters were kept)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    old = step_lr(opt)
    opt.step()
    old.step()
    s = step_lr(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    schedulers = Schedulers(s.optimizer, read_configure_optimizers(([s.optimizer], [s]))[1])
    schedulers.load_state_dict(old.state_dict())
    assert s.last_epoch == 1 and schedulers.steps_in_epoch == 0


def test_a_monitor_the_evaluation_lacks(tmp_path, caplog):
    """strict (Lightning's default): a ConfigError naming the metrics there are; strict=False: a
    warning, and the scheduler is not stepped. No evaluation before the fit's end: refused at set-up."""
    val = DictDataset(4, seed=1)
    with pytest.raises(ll.ConfigError, match=r"conditioned on metric 'giraffe' which is not available. Available "
                                             r"metrics are: \['val/accuracy', 'val/loss'\]"):
        fit(tmp_path / "a", plateau("giraffe"), val=val, eval_on_epoch_end=True)
    fitter, _, lrs = fit(tmp_path / "b", plateau("giraffe", strict=False), val=val, eval_on_epoch_end=True)
    assert lrs == [0.1] * 12 and "strict is set to `False`. Skipping" in caplog.text
    with pytest.raises(ll.ConfigError, match="evaluates at its end only: set eval_on_epoch_end=True"):
        fit(tmp_path / "c", plateau("val/loss"), val=val)
    with pytest.raises(ll.ModuleContractError, match="must include a monitor when a ReduceLROnPlateau"):
        fit(tmp_path / "d", lambda o: ([o], [torch.optim.lr_scheduler.ReduceLROnPlateau(o)]), val=val)


def test_several_schedulers_of_one_optimizer_each_at_its_interval(tmp_path):
    """([opt], [per-step, per-epoch]) on one optimizer, in their order: StepLR(2, 0.5) per step
    halves the rate after steps 2, 4, 6; StepLR(1, 0.1) per epoch divides it by 10 after step 4."""
    def make(o):
        halves = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
        return [o], [{"scheduler": halves, "interval": "step", "name": "halves"}, step_lr(o)]

    fitter, _, lrs = fit(tmp_path, make, max_epochs=2)
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.0025, 0.0025, 0.00125, 0.00125])
    assert isinstance(fitter.scheduler, Schedulers) and len(fitter.scheduler.state_dict()["schedulers"]) == 2


def test_the_forms_and_their_settings():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    s = step_lr(opt)
    for result in ([opt], [s]), ([opt], s), (opt, s), {"optimizer": opt, "lr_scheduler": s}, [(opt, s)]:
        got, (config,) = read_configure_optimizers(result)
        assert got is opt and config.scheduler is s and (config.interval, config.frequency) == ("epoch", 1)
    assert read_configure_optimizers(opt) == (opt, []) == read_configure_optimizers((opt, None))
    p = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    _, (config,) = read_configure_optimizers({"optimizer": opt, "lr_scheduler": p, "monitor": "val_loss"})
    assert (config.monitor, config.reduce_on_plateau, config.strict) == ("val_loss", True, True)
    bad = [({"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "batch"}}, r'must be "step" .* but is "batch"'),
           ({"optimizer": opt, "lr_scheduler": {"scheduler": s, "frequency": 0}}, "frequency=0"),
           ({"optimizer": opt, "lr_scheduler": {"scheduler": s, "foo": 1}}, r"keys \['foo', 'scheduler'\]"),
           ({"optimizer": opt, "lr_scheduler": {}}, "must have the key \"scheduler\""),
           (([opt, opt], [s]), "Several optimizers need manual optimization"),
           (1, "returned a int")]
    for result, match in bad:
        with pytest.raises(ll.ModuleContractError, match=match):
            read_configure_optimizers(result)


def test_a_onecycle_per_epoch_is_questioned(tmp_path, caplog):
    def make(o):
        return {"optimizer": o, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.1, total_steps=3), "interval": "epoch"}}

    with caplog.at_level(logging.WARNING, logger="lightlike"):
        fit(tmp_path, make, max_epochs=1)
    assert "Are you sure you didn't mean 'interval': 'step'?" in caplog.text


# -- reduce_lr_on_plateau: the best checkpoint's names --------------------------------------------
def builtin_plateau(tmp_path, metric, scores, **fields):
    torch.manual_seed(0)
    module, rates = Scored(lambda o: o, scores), Rates()
    module.configure_optimizers = lambda: None  # the built-in optimizer and schedule
    fitter = ll.Fitter(max_epochs=3, batch_size=4, eval_on_epoch_end=True, loggers=[], model_summary=False,
                       optimizer="sgd", learning_rate=0.1, lr_scheduler="reduce_lr_on_plateau",
                       lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.0}, metric_for_best=metric,
                       greater_is_better=False, output_dir=str(tmp_path), callbacks=[rates], **fields)
    fitter.fit(module, DictDataset(16), DictDataset(4, seed=1))
    return fitter, rates.lrs


@pytest.mark.parametrize("metric", ["val/score", "score", "eval_score", "val_score"])
def test_reduce_lr_on_plateau_reads_metric_for_best_as_the_best_checkpoint_does(tmp_path, metric):
    """The spellings the best checkpoint accepts (the HF Trainer's eval_*, Lightning's val_*, a
    name without its set) follow val/score: the rate halves after the stalled third evaluation."""
    fitter, lrs = builtin_plateau(tmp_path, metric, [5, 4, 4])
    assert lrs == [0.1] * 12 and fitter.optimizer.param_groups[0]["lr"] == 0.05
    assert fitter.state.best_step == 8


def test_reduce_lr_on_plateau_with_an_unknown_metric_for_best_saves_first(tmp_path):
    """A metric_for_best the evaluation lacks is the best checkpoint's error, raised after the
    step's checkpoint is written (the plateau does not raise before it)."""
    with pytest.raises(ll.ConfigError, match=r"metric_for_best='scor'.*checkpoint-4 was saved first"):
        builtin_plateau(tmp_path, "scor", [5, 4, 4], save_strategy="epoch")


# -- max_epochs with nothing else to end the run ---------------------------------------------------
@pytest.mark.parametrize("epochs", [1e18, 1e300])
def test_max_epochs_too_many_steps_to_count_is_refused_before_any_step(tmp_path, epochs):
    with pytest.raises(ll.ConfigError, match=r"max_epochs=1e\+(18|300) is 4e\+(18|300) optimizer steps, more than"):
        fit(tmp_path, lambda o: o, max_epochs=epochs, callbacks=[StopAt(1)])
    assert not (tmp_path / "checkpoint-1").exists()
    fit(tmp_path / "fine", lambda o: o, max_epochs=1e18, max_steps=2)  # max_steps ends it: fine


def test_max_epochs_inf_is_refused_by_name():
    with pytest.raises(ll.ConfigError, match="max_epochs=inf never ends: set max_steps"):
        ll.FitConfig(max_epochs=float("inf"))

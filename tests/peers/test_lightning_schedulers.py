"""Lightning's own tests of schedulers returned by configure_optimizers, translated to lightlike
(Lightning 2.6, tests/tests_pytorch/trainer/optimization/test_optimizers.py). Each keeps the
original's assertion and names its origin; a deliberate difference is a strict xfail whose reason
is the line of docs/optimizers.md that states it. Lightning is not imported."""

import peers_common
import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.lr_schedulers import SchedulerConfig, read_configure_optimizers
from lightlike.manual import unwrap_manual_optimizers

ORIGIN = "tests/tests_pytorch/trainer/optimization/test_optimizers.py"


def RandomDataset(size, length):  # noqa: N802 (Lightning's name)
    """Lightning's ``RandomDataset(size, length)``, its rows drawn with seed ``length``."""
    return peers_common.RandomDataset(size, length, seed=length)


class BoringModule(ll.TaskModule):
    """Lightning's ``BoringModel``: Linear(32, 2), MSE against ones, SGD(lr=0.1) and
    StepLR(step_size=1) returned as ([optimizer], [scheduler])."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, batch):
        return self.layer(batch)

    def loss(self, outputs, batch):
        return nn.functional.mse_loss(outputs, torch.ones_like(outputs))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]


def fitter(tmp_path, **fields):
    """``Trainer(default_root_dir=tmp_path, ...)``: batches of 1, as BoringModel's DataLoaders."""
    kw = {"batch_size": 1, "loggers": [], "model_summary": False, "output_dir": str(tmp_path), **fields}
    return ll.Fitter(**kw)


def with_optimizers(make):
    module = BoringModule()
    module.configure_optimizers = lambda: make(module)
    return module


def test_optimizer_with_scheduling(tmp_path):
    """test_optimizers.py::test_optimizer_with_scheduling: one epoch of 12 batches (limit_train_batches
    0.2 of 64), validated twice in it (val_check_interval=0.5): the rate is 0.1 * 0.1."""
    f = fitter(tmp_path, max_epochs=1, eval_every=6)
    f.fit(BoringModule(), RandomDataset(32, 12), RandomDataset(32, 6))
    init_lr = 0.1
    adjusted_lr = [pg["lr"] for pg in f.optimizer.param_groups]
    assert len(f.scheduler.configs) == 1
    assert all(a == adjusted_lr[0] for a in adjusted_lr)
    assert init_lr * 0.1 == adjusted_lr[0]


@pytest.mark.parametrize("in_dict", [False, True])
def test_reducelronplateau_with_no_monitor_raises(tmp_path, in_dict):
    """test_optimizers.py::test_reducelronplateau_with_no_monitor_raises and
    ::test_reducelronplateau_with_no_monitor_in_lr_scheduler_dict_raises."""
    def make(m):
        optimizer = torch.optim.Adam(m.parameters())
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        if in_dict:
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau}}
        return [optimizer], [plateau]

    with pytest.raises(ll.ModuleContractError, match="must include a monitor when a ReduceLROnPlateau"):
        fitter(tmp_path, max_steps=1).fit(with_optimizers(make), RandomDataset(32, 4))


def test_onecyclelr_with_epoch_interval_warns(tmp_path, caplog):
    """test_optimizers.py::test_onecyclelr_with_epoch_interval_warns (a warning at set-up, in
    lightlike's log rather than a RuntimeWarning)."""
    def make(m):
        optimizer = torch.optim.Adam(m.parameters())
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=3)}]

    fitter(tmp_path, max_steps=1).fit(with_optimizers(make), RandomDataset(32, 4))
    assert "Are you sure you didn't mean 'interval': 'step'?" in caplog.text


def plateau_on(monitor):
    def make(m):
        optimizer = torch.optim.Adam(m.parameters())
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
                "monitor": monitor}
    return make


def test_reducelronplateau_scheduling_config():
    """test_optimizers.py::test_reducelronplateau_scheduling: the config read from the optimizer
    dict's top-level monitor."""
    model = BoringModule()
    _, (lr_scheduler,) = read_configure_optimizers(plateau_on("foo")(model))
    assert lr_scheduler == SchedulerConfig(scheduler=lr_scheduler.scheduler, monitor="foo", interval="epoch",
                                           frequency=1, reduce_on_plateau=True, strict=True, name=None)


@pytest.mark.xfail(strict=True, reason="docs/optimizers.md: A monitor names an evaluation metric only: Lightning's "
                                       "monitor of a value logged in `training_step` has no counterpart")
def test_reducelronplateau_scheduling_on_a_training_metric(tmp_path):
    """test_optimizers.py::test_reducelronplateau_scheduling: fast_dev_run with a monitor logged in
    training_step ("foo"), here the training loss: the fit runs."""
    f = fitter(tmp_path, max_epochs=1, eval_on_epoch_end=True)
    f.fit(with_optimizers(plateau_on("train/loss")), RandomDataset(32, 1), RandomDataset(32, 1))
    assert f.state.global_step == 1


def test_optimizer_return_options():
    """test_optimizers.py::test_optimizer_return_options: what each form gives (the manual forms
    through lightlike's manual optimization, which takes each parameter in one optimizer: opt_b
    here holds the bias, not every parameter again)."""
    model = BoringModule()
    opt_a = torch.optim.Adam(model.parameters(), lr=0.002)
    opt_b = torch.optim.SGD([model.layer.bias], lr=0.002)
    opt_a_weight = torch.optim.Adam([model.layer.weight], lr=0.002)
    scheduler_a = torch.optim.lr_scheduler.StepLR(opt_a, 10)
    # single optimizer
    opt, lr_sched = read_configure_optimizers(opt_a)
    assert opt is opt_a and len(lr_sched) == 0
    # opt tuple, opt list (manual optimization)
    for form in (opt_a_weight, opt_b), [opt_a_weight, opt_b]:
        pairs = unwrap_manual_optimizers(form)
        assert [o for o, _ in pairs] == [opt_a_weight, opt_b] and all(s is None for _, s in pairs)
    ref_lr_sched = SchedulerConfig(scheduler=scheduler_a, interval="epoch", frequency=1, reduce_on_plateau=False,
                                   monitor=None, strict=True, name=None)
    # opt tuple of 2 lists, opt tuple of 1 list, opt single dictionary
    for form in ([opt_a], [scheduler_a]), ([opt_a], scheduler_a), {"optimizer": opt_a, "lr_scheduler": scheduler_a}:
        opt, lr_sched = read_configure_optimizers(form)
        assert len(lr_sched) == 1 and opt is opt_a
        assert lr_sched[0] == ref_lr_sched
    # opt list of dictionaries (manual optimization)
    scheduler_b = torch.optim.lr_scheduler.StepLR(opt_b, 10)
    pairs = unwrap_manual_optimizers([{"optimizer": opt_a_weight, "lr_scheduler": None},
                                      {"optimizer": opt_b, "lr_scheduler": scheduler_b}])
    assert [o for o, _ in pairs] == [opt_a_weight, opt_b] and pairs[1][1] is scheduler_b


def test_configure_optimizer_from_dict(tmp_path):
    """test_optimizers.py::test_configure_optimizer_from_dict: {"optimizer": ...} alone fits."""
    make = lambda m: {"optimizer": torch.optim.SGD(params=m.parameters(), lr=1e-03)}  # noqa: E731
    f = fitter(tmp_path, max_steps=1)
    f.fit(with_optimizers(make), RandomDataset(32, 4))
    assert f.state.global_step == 1


@pytest.mark.parametrize("complete_epoch", [True, False])
def test_lr_scheduler_strict(tmp_path, complete_epoch, caplog):
    """test_optimizers.py::test_lr_scheduler_strict: a monitor that is not there raises at the
    epoch's end (strict), warns (strict=False); the scheduler is never stepped. Lightning validates
    every epoch: eval_on_epoch_end=True."""
    def make(strict):
        def configure(m):
            optimizer = torch.optim.Adam(m.parameters())
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "giraffe",
                                                             "strict": strict}}
        return configure

    bounds = {"max_epochs": 1} if complete_epoch else {"max_steps": 1}
    f = fitter(tmp_path / "strict", eval_on_epoch_end=True, **bounds)
    if complete_epoch:
        with pytest.raises(ll.ConfigError, match=r"ReduceLROnPlateau conditioned on metric .* which is not "
                                                 r"available\. Available metrics are:"):
            f.fit(with_optimizers(make(True)), RandomDataset(32, 4), RandomDataset(32, 2))
    else:
        f.fit(with_optimizers(make(True)), RandomDataset(32, 4), RandomDataset(32, 2))
    assert f.scheduler.configs[0].scheduler.last_epoch == 0  # step_mock.assert_not_called()
    if complete_epoch:
        f = fitter(tmp_path / "lenient", eval_on_epoch_end=True, **bounds)
        f.fit(with_optimizers(make(False)), RandomDataset(32, 4), RandomDataset(32, 2))
        assert "ReduceLROnPlateau conditioned on metric 'giraffe' which is not available" in caplog.text
        assert "but strict is set to `False`" in caplog.text
        assert f.scheduler.configs[0].scheduler.last_epoch == 0


def test_unknown_configure_optimizers_raises(tmp_path):
    """test_optimizers.py::test_unknown_configure_optimizers_raises (lightlike's words)."""
    with pytest.raises(ll.ModuleContractError, match="configure_optimizers returned a int"):
        fitter(tmp_path, max_steps=1).fit(with_optimizers(lambda m: 1), RandomDataset(32, 4))


@pytest.mark.xfail(strict=True, reason="docs/optimizers.md: Unknown keys in the optimizer dict or the scheduler dict "
                                       "are an error naming them (Lightning warns and drops them)")
@pytest.mark.parametrize("where", ["optimizer dict", "scheduler dict"])
def test_config_dict_with_extra_keys_warns(tmp_path, where):
    """test_optimizers.py::test_optimizer_config_dict_with_extra_keys_warns and
    ::test_lr_scheduler_with_extra_keys_warns: the fit runs (with a warning)."""
    def make(m):
        optimizer = torch.optim.Adam(m.parameters())
        scheduler = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}
        if where == "optimizer dict":
            return {"optimizer": optimizer, "lr_scheduler": scheduler, "foo": 1, "bar": 2}
        return {"optimizer": optimizer, "lr_scheduler": {**scheduler, "foo": 1, "bar": 2}}

    f = fitter(tmp_path, max_steps=1)
    f.fit(with_optimizers(make), RandomDataset(32, 4))
    assert f.state.global_step == 1


@pytest.mark.parametrize(("configure", "match"), [
    (lambda m, o: {"optimizer": o, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1),
                                                    "interval": "incorrect_unknown_value"}},
     r'The "interval" key in lr scheduler dict must be'),  # ::test_lr_scheduler_with_unknown_interval_raises
    (lambda m, o: {"optimizer": o, "lr_scheduler": {}},
     r'The lr scheduler dict must have the key "scheduler"'),  # ::test_lr_scheduler_with_no_actual_scheduler_raises
    (lambda m, o: ([o], [torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.layer.parameters(), lr=0.1), 1)]),
     "attached with an optimizer that wasn't returned"),  # ::test_invalid_optimizer_in_scheduler
    (lambda m, o: [{"optimizer": o}, torch.optim.Adam(m.parameters())],
     "configure_optimizers returned a list of 2"),  # ::test_invalid_optimizer_dict_raises (lightlike's words)
])
def test_invalid_configurations_raise(tmp_path, configure, match):
    """test_optimizers.py: the tests named beside each case, fit with fast_dev_run."""
    module = BoringModule()
    module.configure_optimizers = lambda: configure(module, torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(ll.ModuleContractError, match=match):
        fitter(tmp_path, max_steps=1).fit(module, RandomDataset(32, 4))


@pytest.mark.parametrize("check_val_every_n_epoch", [1, 2])
def test_lr_scheduler_epoch_step_frequency(tmp_path, check_val_every_n_epoch):
    """test_optimizers.py::test_lr_scheduler_epoch_step_frequency: 4 epochs of 2 batches, the
    scheduler stepped once per epoch plus once at its construction."""
    epochs = 4
    expected_steps = epochs + 1  # every LRScheduler gets called once at init
    f = fitter(tmp_path, max_epochs=epochs, eval_every=2 * check_val_every_n_epoch)
    f.fit(BoringModule(), RandomDataset(32, 2), RandomDataset(32, 2))
    assert f.scheduler.configs[0].scheduler._step_count == expected_steps


@pytest.mark.parametrize(("every_n_train_steps", "epoch_interval"), [(None, True), (2, False), (2, True)])
def test_lr_scheduler_state_updated_before_saving(tmp_path, every_n_train_steps, epoch_interval):
    """test_optimizers.py::test_lr_scheduler_state_updated_before_saving: the checkpoint taken at
    the end of the one epoch of 2 batches holds the scheduler stepped for it (read back from its
    scheduler.pt)."""
    batches, max_epochs = 2, 1
    lr, gamma = 1, 10

    def make(m):
        optimizer = torch.optim.SGD(m.parameters(), lr=lr)
        lr_scheduler_config = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)}
        if not epoch_interval:
            lr_scheduler_config["interval"] = "step"
        return [optimizer], [lr_scheduler_config]

    saving = {"save_strategy": "epoch"} if every_n_train_steps is None else {"save_every": every_n_train_steps}
    f = fitter(tmp_path, max_epochs=max_epochs, eval_on_epoch_end=True, **saving)
    f.fit(with_optimizers(make), RandomDataset(32, batches), RandomDataset(32, 1))
    assert f.state.global_step == batches
    state = torch.load(tmp_path / f"checkpoint-{batches}" / "scheduler.pt", weights_only=True)
    lr_scheduler_config = state["schedulers"][0]
    compare_to = max_epochs if epoch_interval else batches
    assert lr_scheduler_config["_step_count"] - 1 == compare_to  # step count starts at 1
    assert lr_scheduler_config["_last_lr"] == [lr * gamma**compare_to]


def test_invalid_scheduler_missing_state_dict():
    """test_optimizers.py::test_invalid_scheduler_missing_state_dict (lightlike's words, its error class)."""
    class CustomScheduler:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self): ...

    opt = torch.optim.SGD(BoringModule().parameters(), lr=1e-2)
    with pytest.raises(ll.ModuleContractError, match="scheduler of type CustomScheduler without state_dict()"):
        read_configure_optimizers({"optimizer": opt, "lr_scheduler": CustomScheduler(opt)})

"""Manual optimization (a module with ``training_step(batch, ctx)``): against a hand-written loop,
bit for bit; several optimizers and schedulers; precision; callbacks and logging; resume; what it
refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import GAN, HostReads, MixtureDataset, StopAt, flat_params, gan_losses, hand_written_gan
from torch import nn

import lightlike as ll
from lightlike.errors import ConfigError, ModuleContractError, NonFiniteGradientError, NonFiniteLossError


def fitter(tmp_path, name="run", callbacks=None, **kw):
    kw = {"max_steps": 7, "batch_size": 8, "shuffle": False, "seed": 0, "loggers": [], "model_summary": False,
          "accelerator": "cpu", "output_dir": str(tmp_path / name), **kw}
    return ll.Fitter(callbacks=callbacks, **kw)


def optimizer_tensors(opts):
    """Every tensor of the optimizers' states, in order."""
    return [t for o in opts for s in o.state_dict()["state"].values() for t in s.values()]


def assert_same_optimizers(a, b):
    ta, tb = optimizer_tensors(a), optimizer_tensors(b)
    assert len(ta) == len(tb) > 0
    for x, y in zip(ta, tb, strict=True):
        assert torch.equal(x, y)


class ScheduledGAN(GAN):
    """G with a warmup schedule, D with a step decay: (optimizer, scheduler) pairs and a dict."""

    def configure_optimizers(self, config):
        opt_g, opt_d = super().configure_optimizers(config)
        warm = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda s: min(1.0, (s + 1) / 4))
        decay = torch.optim.lr_scheduler.StepLR(opt_d, step_size=2, gamma=0.5)
        return [(opt_g, warm), {"optimizer": opt_d, "lr_scheduler": decay}]


@pytest.mark.parametrize("steps", [1, 11])
def test_gan_bit_identical_to_hand_written_loop(tmp_path, steps):
    """fp32 CPU: two Adam optimizers, D frozen for G's backward: the weights and both optimizers'
    states equal a plain PyTorch loop's after 1 and 11 steps (past an epoch's end)."""
    data = MixtureDataset(n=40)
    torch.manual_seed(3)
    ours = GAN()
    ref, start = copy.deepcopy(ours), flat_params(ours).clone()
    f = fitter(tmp_path, max_steps=steps)
    result = f.fit(ours, data)
    opts, _ = hand_written_gan(ref, data, steps=steps, batch_size=8)
    assert result.global_step == steps
    assert not torch.equal(flat_params(ours), start)
    assert torch.equal(flat_params(ours), flat_params(ref))
    assert_same_optimizers(f.optimizer.optimizers, opts)


def test_schedulers_step_with_their_optimizers_updates(tmp_path):
    """(optimizer, scheduler) pairs and {"optimizer", "lr_scheduler"} dicts: each scheduler steps
    when its optimizer's update is applied, as in the hand-written loop; train/lr is G's rate."""
    data = MixtureDataset(n=40)
    torch.manual_seed(3)
    ours = ScheduledGAN()
    ref = copy.deepcopy(ours)
    f = fitter(tmp_path, max_steps=6, log_every=3)
    f.fit(ours, data)
    opts, scheds = hand_written_gan(ref, data, steps=6, batch_size=8)
    assert torch.equal(flat_params(ours), flat_params(ref))
    assert [s.last_epoch for s in scheds] == [6, 6]
    assert f.scheduler.get_last_lr() == [scheds[0].get_last_lr()[0], scheds[1].get_last_lr()[0]]
    row = f.state.log_history[1]
    assert row["step"] == 6 and row["train/lr"] == scheds[0].get_last_lr()[0] == 1e-2


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true", "32-true"])
def test_precisions_match_the_hand_written_recipe(tmp_path, precision):
    """bf16-mixed: CPU autocast around the step; 16-mixed: torch's multi-optimizer AMP recipe, one
    GradScaler shared by both optimizers, scaler.step per optimizer, one scaler.update per step;
    bf16-true: weights and inputs in bf16. Bit for bit."""
    data = MixtureDataset(n=40)
    torch.manual_seed(3)
    ours = GAN()
    ref = copy.deepcopy(ours)
    f = fitter(tmp_path, max_steps=5, precision=precision)
    f.fit(ours, data)
    kw = {"bf16-mixed": {"autocast": torch.bfloat16},
          "16-mixed": {"autocast": torch.float16, "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**16,
                                                                                growth_interval=2000)},
          "bf16-true": {"dtype": torch.bfloat16}, "32-true": {}}[precision]
    opts, _ = hand_written_gan(ref, data, steps=5, batch_size=8, **kw)
    assert torch.equal(flat_params(ours), flat_params(ref))
    assert_same_optimizers(f.optimizer.optimizers, opts)
    if precision == "16-mixed":  # one update per step: the same scale and growth tracker
        assert f.strategy.precision.scaler.state_dict() == kw["scaler"].state_dict()


class Recorder(ll.Callback):
    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        self.seen.append((state.global_step + 1, optimizer))


def test_callbacks_and_logging(tmp_path):
    """on_before_optimizer_step fires per ctx.step with that optimizer; every returned value is
    logged as train/<key>: the log step's value (train/loss: the mean since the last row)."""
    data = MixtureDataset(n=40)
    torch.manual_seed(3)
    module = GAN()

    class Logged(GAN):
        def training_step(self, batch, ctx):
            out = super().training_step(batch, ctx)
            self.seen_d.append(out["loss_d"])
            self.log_steps.append(ctx.log_step)
            return out

    module = Logged()
    module.seen_d, module.log_steps = [], []
    rec = Recorder()
    f = fitter(tmp_path, max_steps=4, log_every=2, callbacks=[rec])
    f.fit(module, data)
    opt_g, opt_d = f.optimizer.optimizers
    assert rec.seen == [(s, o) for s in range(1, 5) for o in (opt_d, opt_g)]
    assert module.log_steps == [False, True, False, True]
    rows = [r for r in f.state.log_history if "train/loss_d" in r]
    assert [r["step"] for r in rows] == [2, 4]
    assert rows[1]["train/loss_d"] == float(module.seen_d[3].double())  # the log step's value
    assert "train/loss" in rows[0] and "train/grad_norm" not in rows[0]


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Interrupted after step 3 (checkpoint at 2), resumed: weights, both optimizers' and both
    schedulers' states equal the uninterrupted run's, bit for bit."""
    data = MixtureDataset(n=40)
    torch.manual_seed(3)
    whole = ScheduledGAN()
    cut, again = copy.deepcopy(whole), copy.deepcopy(whole)
    f = fitter(tmp_path, "whole", max_steps=7, save_every=2)
    f.fit(whole, data)
    with pytest.raises(KeyboardInterrupt):
        fitter(tmp_path, "cut", max_steps=7, save_every=2, callbacks=[StopAt(3)]).fit(cut, data)
    g = fitter(tmp_path, "cut", max_steps=7, save_every=2)
    g.fit(again, data, resume=True)
    assert g.resumed_from.endswith("checkpoint-2")
    assert torch.equal(flat_params(again), flat_params(whole))
    assert_same_optimizers(g.optimizer.optimizers, f.optimizer.optimizers)
    assert g.scheduler.state_dict() == f.scheduler.state_dict()


class MetricsOnly(GAN):
    """A manual module without loss(): evaluation reports its metrics only."""

    def metrics(self, outputs, batch):
        return {"mean_x": outputs[:, 0].mean()}


def test_evaluation_without_loss(tmp_path):
    data = MixtureDataset(n=24)
    torch.manual_seed(3)
    module = MetricsOnly()
    f = fitter(tmp_path, max_steps=2)
    f.fit(module, data, val=data)
    metrics = f.validate(module, data)
    assert set(metrics) == {"val/mean_x"}
    with torch.no_grad():
        expected = module(data[:]).double()[:, 0].mean()
    assert metrics["val/mean_x"] == pytest.approx(float(expected), abs=1e-6)


@pytest.mark.parametrize(("field", "value"), [("learning_rate", 0.123), ("lr_scheduler", "cosine"),
                                              ("warmup_steps", 2), ("weight_decay", 0.1)])
def test_built_in_optimizer_fields_are_refused(tmp_path, field, value):
    with pytest.raises(ConfigError, match=f"{field}=.*training_step"):
        fitter(tmp_path, **{field: value}).fit(GAN(), MixtureDataset(n=16))


def test_accumulation_and_compile_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="grad_accum_steps=2.*ctx.no_sync"):
        fitter(tmp_path, grad_accum_steps=2).fit(GAN(), MixtureDataset(n=16))
    with pytest.raises(ConfigError, match="compile=True"):
        fitter(tmp_path, "b", compile=True).fit(GAN(), MixtureDataset(n=16))


class BadReturn(GAN):
    def training_step(self, batch, ctx):
        super().training_step(batch, ctx)
        return {"loss_d": torch.tensor(1.0)}


class ForeignOptimizer(GAN):
    def training_step(self, batch, ctx):
        ctx.step(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0))


class SharedParameter(GAN):
    def configure_optimizers(self, config):
        return [torch.optim.Adam(self.parameters()), torch.optim.Adam(self.D.parameters())]


@pytest.mark.parametrize(("module", "message"), [
    (BadReturn, "dict of scalar tensors with a 'loss' key"),
    (ForeignOptimizer, "not return: use the ones in ctx.optimizers"),
    (SharedParameter, "two optimizers over one parameter"),
])
def test_module_mistakes_are_named(tmp_path, module, message):
    with pytest.raises(ModuleContractError, match=message):
        fitter(tmp_path).fit(module(), MixtureDataset(n=16))


def test_nonfinite_gradient_skip_and_raise(tmp_path, caplog):
    """A NaN gradient of D at step 2: under "skip" ctx.step returns False, D's update is skipped
    (G's is applied) and the step is not counted as skipped; under "raise" the fit raises naming
    step 2."""
    class NanAtTwo(GAN):
        def training_step(self, batch, ctx):
            opt_g, opt_d = ctx.optimizers
            fake = self(batch)
            loss_d, generator_loss = gan_losses_nan(self.D, fake, batch["x"], ctx.global_step == 2)
            ctx.backward(loss_d)
            self.results.append(ctx.step(opt_d))
            self.D.requires_grad_(False)
            loss_g = generator_loss()
            ctx.backward(loss_g)
            self.results.append(ctx.step(opt_g))
            self.D.requires_grad_(True)
            return loss_g.detach()

    def gan_losses_nan(D, fake, real, nan):
        from helpers import gan_losses

        loss_d, g = gan_losses(D, fake, real)
        return (loss_d + (torch.sqrt(D[0].weight[0, 0] * 0.0) if nan else 0.0)), g

    torch.manual_seed(3)
    module = NanAtTwo()
    module.results = []
    d_after_one = None

    class Keep(ll.Callback):
        def on_step_end(self, fitter, state, control):
            nonlocal d_after_one
            if state.global_step == 1:
                d_after_one = flat_params(fitter.module.D).clone()
            if state.global_step == 2:
                assert torch.equal(flat_params(fitter.module.D), d_after_one)

    f = fitter(tmp_path, max_steps=3, nonfinite_loss="skip", callbacks=[Keep()])
    f.fit(module, MixtureDataset(n=40))
    assert module.results == [True, True, False, True, True, True]
    assert f.state.skipped_steps == 0 and torch.isfinite(flat_params(module)).all()
    assert "non-finite gradient at step 2: the update of optimizer 1" in caplog.text
    torch.manual_seed(3)
    module = NanAtTwo()
    module.results = []
    # the loss returned at step 2 comes after D's NaN update: either error names step 2
    with pytest.raises((NonFiniteGradientError, NonFiniteLossError), match="step 2"):
        fitter(tmp_path, "raise", max_steps=3).fit(module, MixtureDataset(n=40))


def test_deepspeed_refuses_manual_optimization_by_name():
    from lightlike.strategies import get_strategy

    with pytest.raises(ConfigError, match="strategy='deepspeed_zero2' does not support manual optimization.*"
                                          "DeepSpeed's engine owns one optimizer"):
        get_strategy("deepspeed_zero2", "cpu", None).setup_module(GAN(), manual=True)


def test_progress_bar_and_fitter_attributes(tmp_path, capsys):
    """The progress bar runs over a manual fit; fitter.optimizer holds the optimizers in order."""
    pytest.importorskip("tqdm")
    torch.manual_seed(3)
    module = GAN()
    f = fitter(tmp_path, max_steps=3, progress_bar=True)
    f.fit(module, MixtureDataset(n=24))
    assert [list(o.param_groups[0]["params"]) for o in f.optimizer.optimizers] == \
        [list(module.G.parameters()), list(module.D.parameters())]
    assert "3/3" in capsys.readouterr().err


def test_no_host_read_of_a_tensor_between_log_steps(tmp_path, monkeypatch):
    """Manual optimization adds no device sync to a step that does not log (nonfinite_loss
    "raise", clipping, a scheduler, two ctx.step calls): counted from step 2 to step 9."""
    counter = HostReads(first=2, last=9)
    class Fused(ScheduledGAN):  # torch's unfused Adam reads its own CPU step counter (.item()) per parameter
        def configure_optimizers(self, config):
            (g, warm), d = super().configure_optimizers(config)
            fused = [torch.optim.Adam(o.param_groups[0]["params"], 1e-2, fused=True) for o in (g, d["optimizer"])]
            return [(fused[0], torch.optim.lr_scheduler.LambdaLR(fused[0], lambda s: 1.0)), fused[1]]

    counter.install(monkeypatch)
    fitter(tmp_path, max_steps=12, max_grad_norm=1.0, log_every=10, callbacks=[counter]).fit(
        Fused(), MixtureDataset(n=160))
    assert counter.reads == []
    counter.watching = True  # the counter sees a read: a log step of a manual fit makes some
    fitter(tmp_path, "b", max_steps=2, log_every=1).fit(GAN(), MixtureDataset(n=64))
    assert counter.reads


class AlwaysNan(GAN):
    """Every update's gradient is NaN (a finite loss: sqrt at 0)."""

    def training_step(self, batch, ctx):
        loss = (self(batch) ** 2).mean() + torch.sqrt(self.G[0].weight[0, 0] * 0.0)
        ctx.backward(loss)
        self.stepped.append(ctx.step(ctx.optimizers[0]))
        return loss.detach()


def test_a_fit_whose_every_update_was_skipped_raises(tmp_path):
    """Under "skip", a training step whose every update was skipped counts as a skipped step,
    and a fit that skipped all of them raises (it trained nothing)."""
    module = AlwaysNan()
    module.stepped = []
    start = flat_params(module).clone()
    f = fitter(tmp_path, max_steps=3, nonfinite_loss="skip")
    with pytest.raises(ll.errors.AllStepsSkippedError):
        f.fit(module, MixtureDataset(n=24))
    assert module.stepped == [False, False, False] and f.state.skipped_steps == 3
    assert torch.equal(flat_params(module), start)


class TwiceD(GAN):
    def training_step(self, batch, ctx):
        opt_g, opt_d = ctx.optimizers
        for _ in range(2):
            loss_d, _ = gan_losses(self.D, self(batch), batch["x"])
            ctx.backward(loss_d)
            ctx.step(opt_d)
        return loss_d.detach()


def test_one_step_per_optimizer_under_16_mixed(tmp_path):
    """torch's multi-optimizer AMP recipe updates the scale once per step, after each optimizer
    stepped once: a second ctx.step of one optimizer is named; in 32-true it is allowed."""
    with pytest.raises(ModuleContractError, match=r"ctx.step\(optimizer 1\) was called twice.*16-mixed"):
        fitter(tmp_path, max_steps=2, precision="16-mixed").fit(TwiceD(), MixtureDataset(n=16))
    fitter(tmp_path, "b", max_steps=2).fit(TwiceD(), MixtureDataset(n=16))

"""The HF Trainer's optimizer names of other libraries (lightlike/optimizers/): each one that runs on
the CPU trains exactly as the same library used by hand in a hand-written loop (the same parameter
groups, arguments and LambdaLR schedule: weights torch.equal), and a killed fit resumed from its
checkpoint ends with the uninterrupted fit's weights and optimizer state, bit for bit."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

import lightlike as ll
from lightlike.errors import ConfigError
from tests.helpers import Classifier, DictDataset, StopAt, flat_params

pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")
pytest.importorskip("galore_torch")
pytest.importorskip("schedulefree")

STEPS, BATCH, LR = 8, 4, 1e-2  # (RAdam's first steps are its silent SGD phase: it moves from step 6)


class Wide(Classifier):
    """net.0.weight has 64 * 64 = 4096 elements: bitsandbytes keeps 8-bit state from that size."""

    def __init__(self):
        super().__init__(features=64, classes=3, width=64)


def wide() -> Wide:
    torch.manual_seed(0)
    return Wide()


def data(n: int = STEPS * BATCH) -> DictDataset:
    return DictDataset(n=n, features=64)


def hand_class(name: str):
    import bitsandbytes.optim as bnb
    import galore_torch
    import schedulefree
    import torchao.optim as ao

    betas, eps = (0.9, 0.999), 1e-8
    return {
        "adamw_8bit": lambda g: bnb.AdamW(g, lr=LR, betas=betas, eps=eps, optim_bits=8, is_paged=False),
        "adamw_bnb_8bit": lambda g: bnb.AdamW(g, lr=LR, betas=betas, eps=eps, optim_bits=8, is_paged=False),
        "lion_8bit": lambda g: bnb.Lion(g, lr=LR, betas=betas, optim_bits=8, is_paged=False),
        "lion_32bit": lambda g: bnb.Lion(g, lr=LR, betas=betas, optim_bits=32, is_paged=False),
        "adamw_torch_8bit": lambda g: ao.AdamW8bit(g, lr=LR, betas=betas, eps=eps, block_size=256,
                                                   bf16_stochastic_round=False),
        "adamw_torch_4bit": lambda g: ao.AdamW4bit(g, lr=LR, betas=betas, eps=eps, block_size=256,
                                                   bf16_stochastic_round=False),
        "galore_adamw": lambda g: galore_torch.GaLoreAdamW(g, lr=LR, betas=betas, eps=eps),
        "galore_adafactor": lambda g: galore_torch.GaLoreAdafactor(g, lr=LR, scale_parameter=False,
                                                                   relative_step=False),
        "schedule_free_adamw": lambda g: schedulefree.AdamWScheduleFree(g, lr=LR, betas=betas, eps=eps, warmup_steps=1,
                                                                        weight_lr_power=2.0, r=0.0),
        "schedule_free_sgd": lambda g: schedulefree.SGDScheduleFree(g, lr=LR, warmup_steps=1, weight_lr_power=2.0,
                                                                    r=0.0),
        "schedule_free_radam": lambda g: schedulefree.RAdamScheduleFree(g, lr=LR, betas=betas, eps=eps,
                                                                        weight_lr_power=2.0, r=0.0),
    }[name]


GALORE = {"rank": 4, "update_proj_gap": 2, "scale": 0.5, "proj_type": "std"}
NAMES = ["adamw_8bit", "adamw_bnb_8bit", "lion_8bit", "lion_32bit", "adamw_torch_8bit", "adamw_torch_4bit",
         "galore_adamw", "galore_adafactor", "schedule_free_adamw", "schedule_free_sgd", "schedule_free_radam"]


def settings(name: str, **kw) -> dict:
    cfg = dict(max_steps=STEPS, batch_size=BATCH, shuffle=False, learning_rate=LR, weight_decay=0.1,
               optimizer=name, warmup_steps=1, loggers=[], log_level="warning")
    if name.startswith("galore"):
        cfg.update(optimizer_target_modules=["net.0"], optimizer_kwargs=dict(GALORE))
    return {**cfg, **kw}


def hand_groups(model: Wide, name: str) -> list[dict]:
    """lightlike's decay split by hand (weights decay, biases do not); GaLore's target last."""
    w0, b0, w2, b2 = model.net[0].weight, model.net[0].bias, model.net[2].weight, model.net[2].bias
    if name.startswith("galore"):
        return [{"params": [w2], "weight_decay": 0.1}, {"params": [b0, b2], "weight_decay": 0.0},
                {"params": [w0], "weight_decay": 0.1, **GALORE}]
    return [{"params": [w0, w2], "weight_decay": 0.1}, {"params": [b0, b2], "weight_decay": 0.0}]


def linear(warmup: int, total: int):
    """The HF linear schedule, written out (lightlike's formula)."""
    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    return factor


def hand_loop(model: Wide, name: str, *, steps=STEPS, evaluate_after=(), save_after=()) -> torch.optim.Optimizer:
    """The fit, by hand: the library's class, LambdaLR, and a schedule-free optimizer's train()
    before each step and eval() at each evaluation, save and the end (as the Trainer calls them)."""
    opt = hand_class(name)(hand_groups(model, name))
    # a schedule-free AdamW/SGD warms up itself (warmup_steps=1 above): its schedule has none
    own_warmup = name in ("schedule_free_adamw", "schedule_free_sgd")
    sched = LambdaLR(opt, linear(0 if own_warmup else 1, steps))
    modes = name.startswith("schedule_free")
    for step, batch in enumerate(DataLoader(data(steps * BATCH), batch_size=BATCH), start=1):
        if modes:
            opt.train()
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if modes and (step in evaluate_after or step in save_after):
            opt.eval()
    if modes:
        opt.eval()
    return opt


@pytest.mark.parametrize("name", NAMES)
def test_each_name_trains_as_its_library_by_hand(name, tmp_path):
    fitter = ll.Fitter(output_dir=str(tmp_path), **settings(name))
    fitter.fit(model := wide(), data())
    hand_loop(ref := wide(), name)
    assert type(fitter.optimizer).__name__ == type(hand_class(name)([{"params": [torch.zeros(1)]}])).__name__
    assert torch.equal(flat_params(model), flat_params(ref))
    assert not torch.equal(flat_params(model), flat_params(wide()))  # it trained


def states_equal(a, b) -> bool:
    """Two optimizer state_dicts hold the same values (quantized tensors compared dequantized)."""
    if isinstance(a, torch.Tensor):
        if hasattr(a, "dequantize") and type(a) is not torch.Tensor:
            a, b = a.dequantize(), b.dequantize()
        return type(b) is type(a) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("name", NAMES)
def test_a_killed_fit_resumes_bit_exactly(name, tmp_path):
    cfg = settings(name, save_every=2)
    whole = ll.Fitter(output_dir=str(tmp_path / "whole"), **cfg)
    whole.fit(ref := wide(), data())
    with contextlib.suppress(KeyboardInterrupt):
        ll.Fitter(output_dir=str(tmp_path / "cut"), callbacks=[StopAt(3)], **cfg).fit(wide(), data())
    resumed = ll.Fitter(output_dir=str(tmp_path / "cut"), **cfg)
    resumed.fit(model := wide(), data(), resume=True)
    assert resumed.resumed_from is not None and resumed.resumed_from.endswith("checkpoint-2")
    assert torch.equal(flat_params(model), flat_params(ref))
    assert states_equal(resumed.optimizer.state_dict(), whole.optimizer.state_dict())


@pytest.mark.parametrize("name", ["schedule_free_adamw", "schedule_free_sgd"])
def test_schedule_free_is_in_eval_mode_for_evaluations_and_saves_and_train_mode_for_steps(name, tmp_path):
    """Evaluated after step 2 and saved after step 3: the hand loop makes the same eval()/train()
    calls; the evaluation sees the averaged weights; the fit ends in eval mode."""
    seen = []

    class Watch(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            seen.append(fitter.optimizer.param_groups[0]["train_mode"])

        def on_before_optimizer_step(self, fitter, state, control, optimizer):
            seen.append(optimizer.param_groups[0]["train_mode"])

    fitter = ll.Fitter(eval_every=2, save_every=3, output_dir=str(tmp_path), callbacks=[Watch()],
                       **settings(name, max_steps=4))
    fitter.fit(model := wide(), data(16), DictDataset(n=4, features=64, seed=5))
    hand_loop(ref := wide(), name, steps=4, evaluate_after=(2, 4), save_after=(3, 4))
    assert torch.equal(flat_params(model), flat_params(ref))
    assert seen == [True, True, False, True, True, False]  # steps 1-2, the evaluation, steps 3-4, the last one
    assert fitter.optimizer.param_groups[0]["train_mode"] is False
    # the checkpoint holds the averaged (eval-mode) weights the module had when it was saved
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    assert torch.equal(saved["net.0.weight"], model.net[0].weight.detach())


def test_a_galore_optimizer_from_configure_optimizers_gets_the_configured_schedule(tmp_path):
    """configure_optimizers returns GaLoreAdamW and no scheduler: the configured warmup and decay
    apply to it (as they would to the named optimizer), as the HF Trainer does."""
    import galore_torch

    class OwnGaLore(Wide):
        def configure_optimizers(self, config):
            return galore_torch.GaLoreAdamW(hand_groups(self, "galore_adamw"), lr=LR, betas=(0.9, 0.999), eps=1e-8)

    lrs = []

    class Rates(ll.Callback):
        def on_before_optimizer_step(self, fitter, state, control, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    torch.manual_seed(0)
    fitter = ll.Fitter(callbacks=[Rates()], output_dir=str(tmp_path / "own"), **settings("adamw", warmup_steps=2))
    fitter.fit(model := OwnGaLore(), data())
    assert lrs[:4] == [0.0, LR * 1 / 2, LR * 1.0, LR * (STEPS - 3) / (STEPS - 2)] and len(lrs) == STEPS
    named = ll.Fitter(output_dir=str(tmp_path / "named"), **settings("galore_adamw", warmup_steps=2))
    named.fit(ref := wide(), data())
    assert torch.equal(flat_params(model), flat_params(ref))  # the named optimizer: the same schedule


def test_lightning_style_configure_optimizers_without_a_scheduler_gets_the_schedule_too(tmp_path):
    class Plain(Classifier):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    fitter = ll.Fitter(max_steps=2, batch_size=4, loggers=[], lr_scheduler="linear", warmup_steps=1,
                       output_dir=str(tmp_path))
    fitter.fit(Plain(), DictDataset(n=8))
    assert isinstance(fitter.scheduler, LambdaLR) and fitter.scheduler.get_last_lr() == [0.0]  # linear: 0 at the end


# -- bad input: one ConfigError before any step ----------------------------------------------------
def test_optim_args_string_is_parsed_as_the_trainer_writes_it():
    cfg = ll.FitConfig(max_steps=1, optimizer="galore_adamw", optimizer_target_modules="all-linear",
                       optimizer_kwargs="rank=4, update_proj_gap=2,scale=0.5,proj_type=std")
    assert cfg.optimizer_kwargs == {"rank": 4, "update_proj_gap": 2, "scale": 0.5, "proj_type": "std"}
    cfg = ll.FitConfig(max_steps=1, optimizer="adamw_torch_8bit", optimizer_kwargs="bf16_stochastic_round=true")
    assert cfg.optimizer_kwargs == {"bf16_stochastic_round": True}
    with pytest.raises(ConfigError, match=r"'rank4' is not key=value"):
        ll.FitConfig(max_steps=1, optimizer="galore_adamw", optimizer_kwargs="rank4")


@pytest.mark.parametrize(("fields", "match"), [
    ({"optimizer": "lion_8bit", "optimizer_kwargs": {"amsgrad": True}},
     r"optimizer='lion_8bit' \(bitsandbytes.optim.Lion\) takes no argument 'amsgrad'.*Its arguments: betas"),
    ({"optimizer": "adamw_8bit", "optimizer_kwargs": {"optim_bits": 32}}, r"optim_bits=32 contradicts it"),
    ({"optimizer": "galore_adamw_layerwise"}, r"not offered: GaLore's layer-wise form .*optimizer='galore_adamw'"),
    ({"optimizer": "galore_adamw", "optimizer_kwargs": {"rnak": 4}}, r"takes no argument 'rnak'.*rank, update_proj_gap"),
    ({"optimizer": "lomo", "optimizer_kwargs": {"clip_grad_norm": 1.0}}, r"'clip_grad_norm' \(set max_grad_norm\)"),
])
def test_bad_arguments_are_one_error_at_config_time(fields, match):
    with pytest.raises(ConfigError, match=match):
        ll.FitConfig(max_steps=1, **fields)


@pytest.mark.parametrize(("fields", "match"), [
    ({"optimizer": "galore_adamw", "optimizer_target_modules": ["attn"]},
     r"optimizer_target_modules=\['attn'\] matches no trainable nn.Linear module of Classifier. Its nn.Linear "
     r"modules: net.0, net.2"),
    ({"optimizer": "galore_adamw"}, r"galore_adamw' needs optimizer_target_modules"),
    ({"optimizer": "adamw", "optimizer_target_modules": "all-linear"}, r"is for the GaLore optimizers"),
    ({"optimizer": "paged_adamw_8bit"}, r"runs on CUDA only, and this run's device is cpu"),
    ({"optimizer": "galore_adamw_8bit", "optimizer_target_modules": "all-linear"}, r"runs on CUDA only"),
    ({"optimizer": "lion_32bit", "adam_epsilon": 1e-6}, r"adam_epsilon=1e-06: optimizer='lion_32bit' .* takes no eps"),
])
def test_bad_set_up_is_one_error_before_any_step(fields, match, tmp_path):
    class NoStep(ll.Callback):
        def on_step_start(self, fitter, state, control):
            raise AssertionError("a step was taken")

    with pytest.raises(ConfigError, match=match):
        ll.Fitter(max_steps=1, batch_size=4, loggers=[], callbacks=[NoStep()], output_dir=str(tmp_path),
                  **fields).fit(Classifier(), DictDataset(n=8))


def test_a_missing_library_names_the_extra_to_install():
    code = ("import sys; sys.modules['schedulefree'] = None; sys.modules['galore_torch'] = None\n"
            "import lightlike as ll\n"
            "for name, extra in (('schedule_free_adamw', 'schedulefree'), ('galore_adamw', 'galore')):\n"
            "    try:\n"
            "        ll.FitConfig(max_steps=1, optimizer=name)\n"
            "    except ll.ConfigError as e:\n"
            "        assert f\"pip install 'lightlike[{extra}]'\" in str(e), e\n"
            "    else:\n"
            "        raise SystemExit('no error for ' + name)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_import_lightlike_imports_none_of_the_libraries():
    libs = ["galore_torch", "bitsandbytes", "torchao", "schedulefree", "lomo_optim", "transformers"]
    code = f"import sys, lightlike; print([m for m in {libs!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr[-2000:])


# -- LOMO: the update fused into backward, through the step context --------------------------------
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_lomo_trains_as_lomo_by_hand_and_leaves_no_hook_behind(max_grad_norm, tmp_path):
    from lomo_optim import Lomo

    fitter = ll.Fitter(output_dir=str(tmp_path), **settings("lomo", weight_decay=0.0, max_grad_norm=max_grad_norm))
    fitter.fit(model := wide(), data())
    ref = wide()
    opt = Lomo(ref, lr=LR, clip_grad_norm=max_grad_norm)  # as the HF Trainer drives it: lr from the scheduler
    sched = LambdaLR(opt, linear(1, STEPS))
    for batch in DataLoader(data(), batch_size=BATCH):
        loss = ref.loss(ref(batch), batch)
        if max_grad_norm is not None:
            opt.grad_norm(loss)
        opt.fused_backward(loss, sched.get_last_lr()[0])
        sched.step()
    assert torch.equal(flat_params(model), flat_params(ref))
    assert not torch.equal(flat_params(model), flat_params(wide()))
    if max_grad_norm is not None:
        assert "train/grad_norm" in fitter.state.log_history[-1]
    # the module is left as it came: a plain backward after the fit keeps its gradients, moves nothing
    before = flat_params(model).clone()
    batch = next(iter(DataLoader(data(), batch_size=BATCH)))
    model.loss(model(batch), batch).backward()
    assert torch.equal(flat_params(model), before) and all(p.grad is not None for p in model.parameters())


def test_lomo_is_not_taken_for_a_loss_that_reaches_no_parameter(tmp_path, caplog):
    """LOMO updates inside backward and leaves no gradient on the parameters: the step's check
    that the loss reaches them (at the first ordinary update) must not read that as a loss
    connected to nothing (the callback that checked it before ran in LOMO's fused step, and said so)."""
    with caplog.at_level(logging.WARNING, logger="lightlike"):
        ll.Fitter(output_dir=str(tmp_path), **settings("lomo", weight_decay=0.0)).fit(model := wide(), data())
    assert not [r.getMessage() for r in caplog.records if "no gradient reached" in r.getMessage()]
    assert not torch.equal(flat_params(model), flat_params(wide()))  # it trained


def test_lomo_resumes_bit_exactly(tmp_path):
    cfg = settings("lomo", weight_decay=0.0, save_every=2)
    ll.Fitter(output_dir=str(tmp_path / "whole"), **cfg).fit(ref := wide(), data())
    with contextlib.suppress(KeyboardInterrupt):
        ll.Fitter(output_dir=str(tmp_path / "cut"), callbacks=[StopAt(3)], **cfg).fit(wide(), data())
    ll.Fitter(output_dir=str(tmp_path / "cut"), **cfg).fit(model := wide(), data(), resume=True)
    assert torch.equal(flat_params(model), flat_params(ref))


@pytest.mark.parametrize(("fields", "match"), [
    ({"grad_accum_steps": 2}, r"grad_accum_steps \(each backward updates"),
    ({"nonfinite_loss": "skip"}, r"nonfinite_loss='skip'"),
    ({"weight_decay": 0.1}, r"weight_decay \(LOMO decays every parameter alike"),
    ({"precision": "16-mixed"}, r"precision='16-mixed'"),
])
def test_what_cannot_work_with_lomo_is_refused_by_name_at_set_up(fields, match, tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer='lomo' cannot work with: .*" + match):
        ll.Fitter(max_steps=1, batch_size=4, loggers=[], optimizer="lomo", output_dir=str(tmp_path),
                  **fields).fit(Classifier(), DictDataset(n=8))

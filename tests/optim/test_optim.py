"""lightlike.optim: parameter groups, optimizers, schedules (against hand-computed values) and
the normalisation of what configure_optimizers returns."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.optim import (
    build_optimizer,
    build_scheduler,
    param_groups,
    total_warmup_steps,
    unwrap_configure_optimizers,
)

LR = 1e-3


def cfg(**kw):
    kw.setdefault("max_steps", 100)
    kw.setdefault("learning_rate", LR)
    return ll.FitConfig(**kw)


def make(name, total, **kw):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    return opt, build_scheduler(opt, cfg(lr_scheduler=name, **kw), total)


def trace(name, total, extra=0, **kw):
    """Learning rate after k scheduler steps, for k = 0 .. total + extra."""
    opt, sched = make(name, total, **kw)
    out = []
    for _ in range(total + extra + 1):
        lr = sched.get_last_lr()[0]
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, abs=0)  # the optimizer really uses it
        out.append(lr)
        opt.step()
        sched.step()
    return out


# -- schedules -------------------------------------------------------------------------------------
def test_linear():
    lr = trace("linear", 100, warmup_steps=10)
    # warmup: k/10 * LR; then (100 - k) / 90 * LR
    expected = {0: 0.0, 1: 1e-4, 5: 5e-4, 10: 1e-3, 55: 5e-4, 91: 1e-4, 99: LR / 90, 100: 0.0}
    assert [lr[k] for k in expected] == pytest.approx(list(expected.values()), abs=1e-15)


def test_linear_without_warmup_starts_at_peak_and_stays_at_zero_past_the_end():
    lr = trace("linear", 40, extra=5)
    assert lr[0] == LR and lr[10] == pytest.approx(0.75 * LR) and lr[20] == pytest.approx(0.5 * LR)
    assert lr[40:] == [0.0] * 6


def test_cosine_half_wave():
    lr = trace("cosine", 110, warmup_steps=10)  # decay over 100 steps after 10 of warmup
    assert lr[5] == pytest.approx(0.5 * LR)
    assert lr[10] == pytest.approx(LR)
    assert lr[60] == pytest.approx(0.5 * LR)  # mid-point of the decay
    assert lr[35] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi / 4)))  # a quarter in
    assert lr[85] == pytest.approx(LR * 0.5 * (1 + math.cos(3 * math.pi / 4)))
    assert lr[110] == pytest.approx(0.0, abs=1e-15)
    assert all(a >= b for a, b in zip(lr[10:-1], lr[11:], strict=True))  # monotone after warmup


def test_cosine_num_cycles_one_is_a_full_wave():
    lr = trace("cosine", 100, num_cycles=1.0)
    assert lr[0] == pytest.approx(LR) and lr[50] == pytest.approx(0.0, abs=1e-15)
    assert lr[25] == pytest.approx(0.5 * LR) and lr[100] == pytest.approx(LR)


def test_cosine_with_restarts_shape():
    lr = trace("cosine_with_restarts", 100, num_cycles=2)
    # progress p = k/100; factor = 0.5 * (1 + cos(pi * ((2p) % 1)))
    assert lr[0] == pytest.approx(LR) and lr[25] == pytest.approx(0.5 * LR)
    assert lr[49] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 0.98)))
    assert lr[50] == pytest.approx(LR)  # hard restart back to the peak
    assert lr[75] == pytest.approx(0.5 * LR)
    assert lr[99] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * 0.98)))
    assert lr[100] == 0.0
    with_warmup = trace("cosine_with_restarts", 110, warmup_steps=10, num_cycles=2)
    assert with_warmup[5] == pytest.approx(0.5 * LR) and with_warmup[60] == pytest.approx(LR)


def test_cosine_with_restarts_num_cycles_is_an_int_count():
    # the default 0.5 means one cycle: the same as a half-wave cosine
    assert trace("cosine_with_restarts", 60) == pytest.approx(trace("cosine", 60, num_cycles=0.5), abs=1e-15)
    lr = trace("cosine_with_restarts", 90, num_cycles=3.9)  # int(3.9) = 3 restarts: peaks at 0, 30, 60
    assert [lr[k] for k in (0, 30, 60)] == pytest.approx([LR] * 3)
    assert lr[15] == pytest.approx(0.5 * LR) and lr[45] == pytest.approx(0.5 * LR)


def test_polynomial():
    end = 1e-4
    lr = trace("polynomial", 110, extra=3, warmup_steps=10, lr_end=end, power=2.0)
    # (LR - end) * (1 - (k - 10) / 100) ** 2 + end
    assert lr[5] == pytest.approx(0.5 * LR)
    assert lr[10] == pytest.approx(LR)
    assert lr[60] == pytest.approx((LR - end) * 0.25 + end)
    assert lr[90] == pytest.approx((LR - end) * 0.04 + end)
    assert lr[110:] == pytest.approx([end] * 4)  # and it stays at lr_end past the end
    linear = trace("polynomial", 100, lr_end=end, power=1.0)
    assert linear[50] == pytest.approx((LR + end) / 2)


def test_polynomial_lr_end_must_be_below_learning_rate():
    with pytest.raises(ll.ConfigError, match=r"lr_end \(0.01\) < learning_rate \(0.001\)"):
        make("polynomial", 100, lr_end=1e-2)
    with pytest.raises(ll.ConfigError, match=r"lr_end \(0.001\) < learning_rate \(0.001\)"):
        make("polynomial", 100, lr_end=LR)


def test_constant_and_constant_with_warmup():
    assert trace("constant", 50) == [LR] * 51
    lr = trace("constant_with_warmup", 50, warmup_steps=4)
    assert lr[:6] == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR, LR]) and lr[50] == LR
    for warmup in ({"warmup_steps": 3}, {"warmup_ratio": 0.1}):
        with pytest.raises(ll.ConfigError, match="constant_with_warmup"):
            make("constant", 50, **warmup)


@pytest.mark.parametrize(("ratio", "total", "expected"), [
    (0.05, 90, 5),    # 4.5 rounds up
    (0.1, 95, 10),    # 9.5 rounds up
    (0.07, 100, 7),   # 7.000000000000001 in floats: still 7
    (0.1, 30, 3),
    (0.001, 10, 1),   # any positive ratio gives at least one step
    (0.0, 100, 0),
])
def test_warmup_ratio_rounds_up(ratio, total, expected):
    assert total_warmup_steps(cfg(warmup_ratio=ratio), total) == expected


def test_warmup_steps_win_over_ratio_and_ratio_drives_the_schedule():
    assert total_warmup_steps(cfg(warmup_steps=3, warmup_ratio=0.5), 100) == 3
    lr = trace("linear", 90, warmup_ratio=0.05)  # 5 warmup steps, then 85 of decay
    assert lr[1] == pytest.approx(LR / 5) and lr[5] == pytest.approx(LR)
    assert lr[6] == pytest.approx(LR * 84 / 85)


@pytest.mark.parametrize("name", ["linear", "cosine", "cosine_with_restarts", "polynomial",
                                  "constant", "constant_with_warmup"])
def test_scheduler_state_round_trip(name):
    kw = {} if name == "constant" else {"warmup_steps": 10}
    opt, sched = make(name, 100, num_cycles=2 if name == "cosine_with_restarts" else 0.5, **kw)
    for _ in range(37):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # plain values only
    opt2, sched2 = make(name, 100, num_cycles=2 if name == "cosine_with_restarts" else 0.5, **kw)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 37 and sched2.get_last_lr() == sched.get_last_lr()
    for _ in range(5):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    pickle.loads(pickle.dumps(sched.lr_lambdas[0]))  # module-level functions: picklable


def test_unknown_scheduler_and_bad_settings_raise():
    c = cfg()
    c.lr_scheduler = "step"  # bypassing FitConfig's own validation
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    with pytest.raises(ll.ConfigError, match="choose one of: linear, cosine"):
        build_scheduler(opt, c, 10)
    with pytest.raises(ll.ConfigError, match="total_steps > 0"):
        build_scheduler(opt, cfg(), 0)
    with pytest.raises(ll.ConfigError, match="num_cycles > 0"):
        make("cosine", 10, num_cycles=0.0)


# -- parameter groups ------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.scale = nn.Parameter(torch.ones(4))  # 1-D: a hand-rolled norm's gain
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied


def names_of(net, groups):
    names = {id(p): n for n, p in net.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in groups]


def test_param_groups_exact_split():
    net = Net()
    groups = param_groups(net, 0.1)
    assert names_of(net, groups) == [
        ["emb.weight", "lin.weight"],  # the tied head is emb.weight, once; embeddings decay
        ["scale", "lin.bias", "norm.weight", "norm.bias", "bn.weight", "bn.bias"],
    ]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_a_norm_layer_s_matrix_weight_does_not_decay():
    """``LayerNorm([4, 8])`` has a 2-D weight: the fewer-than-2-dims rule alone would decay it
    (ignoring NORM_TYPES passed the suite: every norm weight in it was 1-D)."""
    net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm([4, 8]))
    decay, no_decay = param_groups(net, 0.1)
    assert [tuple(p.shape) for p in decay["params"]] == [(32, 8)]
    assert [tuple(p.shape) for p in no_decay["params"]] == [(32,), (4, 8), (4, 8)]


def test_bias_named_parameters_do_not_decay_as_in_the_hf_trainer():
    """Only a parameter named exactly ``bias`` was left out: T5's relative_attention_bias, Swin's
    relative_position_bias_table and MultiheadAttention's bias_k/bias_v decayed, where the HF
    Trainer (whose rule the docs name) leaves out every name containing "bias". Checked against
    transformers' own ``get_decay_parameter_names`` on real models, every 2-D+ parameter."""
    attention = nn.MultiheadAttention(8, 2, add_bias_kv=True)
    decay, no_decay = param_groups(attention, 0.1)
    assert names_of(attention, [decay, no_decay]) == [
        ["in_proj_weight", "out_proj.weight"], ["in_proj_bias", "bias_k", "bias_v", "out_proj.bias"]]
    transformers = pytest.importorskip("transformers")
    models = [
        transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)),
        transformers.SwinModel(transformers.SwinConfig(
            image_size=8, patch_size=2, embed_dim=8, depths=[1], num_heads=[2], window_size=2)),
    ]
    for model in models:
        hf_decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        ours = names_of(model, param_groups(model, 0.1))[0]
        shapes = dict(model.named_parameters())
        # (HF lists a tied weight under each of its names; named_parameters() under the first)
        assert set(ours) == {n for n in hf_decay if n in shapes and shapes[n].ndim >= 2}, type(model).__name__
        assert any("bias" in n for n, p in shapes.items() if p.ndim >= 2 and n not in ours)


def test_param_groups_without_weight_decay_is_one_group_in_named_order():
    net = Net()
    groups = param_groups(net, 0.0)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert names_of(net, groups) == [trainable]


def test_param_groups_tied_once_and_empty_groups_left_out():
    net = Net()
    flat = [p for g in param_groups(net, 0.1) for p in g["params"]]
    assert len(flat) == len({id(p) for p in flat}) == 8
    only_biases = nn.Linear(3, 3)
    only_biases.weight.requires_grad_(False)
    assert names_of(only_biases, param_groups(only_biases, 0.1)) == [["bias"]]
    assert param_groups(nn.ReLU(), 0.1) == []
    with pytest.raises(ll.ModuleContractError, match="no trainable parameters"):
        build_optimizer(nn.ReLU(), cfg())


def test_adamw_decays_only_the_decay_group():
    net = Net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = build_optimizer(net, cfg(weight_decay=0.5, learning_rate=0.1))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)  # Adam's update is 0: only decay moves weights
    opt.step()
    for n, p in net.named_parameters():
        factor = 1 - 0.1 * 0.5 if n in ("emb.weight", "lin.weight") else 1.0
        torch.testing.assert_close(p.detach(), before[n] * factor)


# -- optimizers ------------------------------------------------------------------------------------
def test_sgd_settings_pass_through():
    sgd = build_optimizer(Net(), cfg(optimizer="sgd", momentum=0.9, learning_rate=0.1, weight_decay=0.01))
    assert isinstance(sgd, torch.optim.SGD)
    assert [(g["lr"], g["momentum"], g["weight_decay"]) for g in sgd.param_groups] == [
        (0.1, 0.9, 0.01), (0.1, 0.9, 0.0)]


def test_adamw_settings_pass_through():
    adamw = build_optimizer(Net(), cfg(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, learning_rate=0.02))
    assert type(adamw) is torch.optim.AdamW
    g = adamw.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.02, (0.8, 0.95), 1e-6, 0.0)
    assert adamw.defaults["fused"] is True  # fused=None: torch's fused kernel, which the CPU has


def test_adamw_default_fused_kernel_matches_torch_fused_adamw_exactly():
    torch.manual_seed(0)
    ours, ref = nn.Linear(6, 3), nn.Linear(6, 3)
    ref.load_state_dict(ours.state_dict())
    opt = build_optimizer(ours, cfg(learning_rate=0.05))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0, fused=True)
    for _ in range(5):
        x = torch.randn(4, 6)
        for m, o in ((ours, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_adamw_not_fused_for_integer_buffers_or_unsupported_devices():
    net = nn.Linear(3, 2).to("meta")
    assert not build_optimizer(net, cfg()).defaults["fused"]


def test_adamw_fused_true_on_cpu_is_passed_and_steps():
    net = nn.Linear(3, 2)
    opt = build_optimizer(net, cfg(fused=True))
    assert opt.defaults["fused"] is True
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert build_optimizer(net, cfg(fused=False)).defaults["fused"] is None  # False: nothing passed


@pytest.mark.parametrize(("settings", "match"), [
    ({"momentum": 0.9}, "momentum=0.9 is an SGD setting"),
    ({"optimizer": "rmsprop", "fused": True}, r"fused=True: optimizer='rmsprop' \(torch.optim.RMSprop\) has no fused"),
    ({"adam_beta1": 1.0}, r"adam_beta1 must be in \[0, 1\)"),
    ({"adam_beta2": -0.1}, r"adam_beta2 must be in \[0, 1\)"),
    ({"adam_epsilon": -1.0}, "adam_epsilon must be >= 0"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"optimizer": "sgd", "momentum": -0.5}, "momentum must be >= 0"),
])
def test_invalid_optimizer_settings_raise(settings, match):
    with pytest.raises(ll.ConfigError, match=match):
        build_optimizer(Net(), cfg(**settings))


def test_unknown_optimizer_raises():
    c = cfg()
    c.optimizer = "adamax"
    with pytest.raises(ll.ConfigError, match="optimizer='adamax' is not valid; choose one of: adamw, adam, sgd"):
        build_optimizer(Net(), c)


# -- configure_optimizers --------------------------------------------------------------------------
def test_configure_optimizers_accepted_forms():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert unwrap_configure_optimizers(opt) == (opt, None)
    assert unwrap_configure_optimizers((opt, sched)) == (opt, sched)
    assert unwrap_configure_optimizers([opt, sched]) == (opt, sched)
    assert unwrap_configure_optimizers((opt, None)) == (opt, None)
    assert unwrap_configure_optimizers({"optimizer": opt, "lr_scheduler": sched}) == (opt, sched)
    assert unwrap_configure_optimizers({"optimizer": opt}) == (opt, None)
    # Lightning's shapes (docs/migrating.md): lists of one, and its scheduler dict stepped per step
    assert unwrap_configure_optimizers([opt]) == (opt, None)
    assert unwrap_configure_optimizers(([opt], [sched])) == (opt, sched)
    assert unwrap_configure_optimizers(([opt], [])) == (opt, None)
    assert unwrap_configure_optimizers([{"optimizer": opt, "lr_scheduler": sched}]) == (opt, sched)
    step = {"scheduler": sched, "interval": "step", "frequency": 1}
    assert unwrap_configure_optimizers({"optimizer": opt, "lr_scheduler": step}) == (opt, sched)


def test_lightning_style_configure_optimizers_without_config(tmp_path, caplog):
    """``def configure_optimizers(self)`` (Lightning's signature) is called without the config;
    optimizer settings given to the Fitter then go unused, and a warning names them."""
    from helpers import Classifier, DictDataset

    class Lightningish(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2),
                                                       "interval": "step"}}

    fitter = ll.Fitter(max_steps=3, batch_size=4, output_dir=str(tmp_path), loggers=[])
    fitter.fit(Lightningish(), DictDataset(n=16))
    assert isinstance(fitter.optimizer, torch.optim.SGD) and fitter.scheduler.get_last_lr() == [0.05]
    assert "configure_optimizers() takes no config" not in caplog.text  # nothing set: nothing to say
    ll.Fitter(max_steps=1, batch_size=4, output_dir=str(tmp_path / "b"), loggers=[], learning_rate=1e-5,
              warmup_steps=2).fit(Lightningish(), DictDataset(n=16))
    assert ("Lightningish.configure_optimizers() takes no config, so learning_rate=1e-05, warmup_steps=2 set "
            "for this fit are not used") in caplog.text


def test_configure_optimizers_rejected_forms():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 1)
    cases = [
        ("adam", "returned a str; return an Optimizer"),
        (None, "returned a NoneType"),
        ((sched, opt), r"a tuple of 2 \(StepLR, SGD\)"),
        (([opt, opt], [sched]), r"a tuple of 2 \(list, list\)"),
        ({"optimizer": opt, "lr_scheduler": {"scheduler": sched}}, r"interval='epoch'.*Lightning's default"),
        ({"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}},
         "frequency=2"),
        ({"optimizer": opt, "lr_scheduler": {"sched": sched}}, r"scheduler dict with keys \['sched'\]"),
        ((opt, sched, sched), "a tuple of 3"),
        ({"lr_scheduler": sched}, "no Optimizer under 'optimizer'"),
        ({"optimizer": opt, "monitor": "val/loss"}, r"unknown key\(s\) \['monitor'\]"),
        ((opt, "cosine"), r"scheduler of type str without step\(\), get_last_lr\(\)"),
        ((opt, other), "built on a different optimizer"),
        ((opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt)), "ReduceLROnPlateau"),
    ]
    for result, match in cases:
        with pytest.raises(ll.ModuleContractError, match=match):
            unwrap_configure_optimizers(result)
    with pytest.raises(ll.ModuleContractError, match=r"\(optimizer, scheduler\), or \{'optimizer'"):
        unwrap_configure_optimizers(42)


def test_the_loop_clears_gradients_through_the_optimizers_zero_grad(tmp_path):
    """After every step the loop calls ``optimizer.zero_grad(set_to_none=True)``: torch's sets every
    gradient of every group to None; an optimizer that overrides ``zero_grad`` decides for itself
    (here it keeps them)."""
    from helpers import Classifier, DictDataset

    calls = []

    class OwnZeroGrad(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)  # e.g. an optimizer that keeps gradient buffers

    class Own(Classifier):
        def configure_optimizers(self):
            return OwnZeroGrad(self.parameters(), lr=0.1)

    def fit(module, name):
        ll.Fitter(max_steps=2, batch_size=4, output_dir=str(tmp_path / name), loggers=[],
                  model_summary=False).fit(module, DictDataset(n=16))
        return module

    assert all(p.grad is None for p in fit(Classifier(), "torch").parameters())
    kept = fit(Own(), "own")
    assert calls == [True, True]
    assert all(p.grad is not None for p in kept.parameters())  # its zero_grad decided: kept

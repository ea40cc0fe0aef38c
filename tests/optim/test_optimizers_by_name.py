"""The built-in optimizers by name with optimizer_kwargs: each is torch.optim's class, built by hand
here with the same parameter groups and arguments, and its steps give the same weights bit for
bit; an argument the class does not take is one error naming the optimizer and its arguments."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import lightlike as ll
from lightlike.optim import build_optimizer
from tests.helpers import Classifier, DictDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)


#: name, optimizer_kwargs, the torch class, the arguments lightlike passes it besides those
CASES = [
    ("adamw", {"amsgrad": True}, torch.optim.AdamW, {"betas": (0.8, 0.99), "eps": 1e-6, "fused": True}),
    ("adamw_torch_fused", {}, torch.optim.AdamW, {"betas": (0.8, 0.99), "eps": 1e-6, "fused": True}),
    ("adam", {"amsgrad": True}, torch.optim.Adam, {"betas": (0.8, 0.99), "eps": 1e-6, "fused": True}),
    ("nadam", {"momentum_decay": 0.01}, torch.optim.NAdam, {"betas": (0.8, 0.99), "eps": 1e-6}),
    ("radam", {"decoupled_weight_decay": True}, torch.optim.RAdam, {"betas": (0.8, 0.99), "eps": 1e-6}),
    ("sgd", {"nesterov": True, "dampening": 0.0}, torch.optim.SGD, {"momentum": 0.9}),
    ("rmsprop", {"alpha": 0.9, "centered": True}, torch.optim.RMSprop, {"momentum": 0.9}),
    ("adagrad", {"lr_decay": 0.01, "initial_accumulator_value": 0.1}, torch.optim.Adagrad, {}),
    ("adafactor", {"beta2_decay": -0.5}, torch.optim.Adafactor, {}),
]


@pytest.mark.parametrize(("name", "kwargs", "cls", "fields"), CASES, ids=[c[0] for c in CASES])
def test_each_name_is_torchs_class_with_its_arguments_and_steps_alike(name, kwargs, cls, fields):
    adam_family = "betas" in inspect.signature(cls).parameters
    settings = {"adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6} if adam_family else {}
    if "momentum" in fields:
        settings["momentum"] = 0.9
    net, ref_net = Net(), Net()
    opt = build_optimizer(net, ll.FitConfig(max_steps=3, optimizer=name, optimizer_kwargs=kwargs,
                                            learning_rate=0.01, weight_decay=0.1, **settings))
    # by hand: the weight matrix decays; the bias and the norm's parameters do not
    ref = cls([{"params": [ref_net.lin.weight], "weight_decay": 0.1},
               {"params": [ref_net.lin.bias, ref_net.norm.weight, ref_net.norm.bias], "weight_decay": 0.0}],
              lr=0.01, **fields, **kwargs)
    assert type(opt) is cls
    for key, value in {**fields, **kwargs}.items():
        assert opt.param_groups[0][key] == value == ref.param_groups[0][key]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for o, n in ((opt, net), (ref, ref_net)):
            o.zero_grad()
            n.norm(n.lin(x)).pow(2).mean().backward()
            o.step()
    for a, b in zip(net.parameters(), ref_net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_argument_the_optimizer_does_not_take_names_it_and_its_arguments():
    with pytest.raises(ll.ConfigError) as err:
        ll.FitConfig(optimizer="sgd", optimizer_kwargs={"betas": (0.9, 0.99), "nesterov": True})
    valid = [p for p in inspect.signature(torch.optim.SGD).parameters if p not in ("params", "lr", "weight_decay")]
    assert str(err.value) == ("optimizer_kwargs: optimizer='sgd' (torch.optim.SGD) takes no argument 'betas'. "
                              f"Its arguments: {', '.join(valid)}")
    with pytest.raises(ll.ConfigError, match=r"optimizer='adafactor' \(torch.optim.Adafactor\) takes no argument "
                                             r"'momentum'.*Its arguments: beta2_decay, eps, d,"):
        ll.FitConfig(optimizer="adafactor", optimizer_kwargs={"momentum": 0.9})


@pytest.mark.parametrize(("fields", "match"), [
    ({"optimizer": "adam", "optimizer_kwargs": {"lr": 0.1, "weight_decay": 0.1}},
     r"gets 'lr' \(set learning_rate\), 'weight_decay' \(set weight_decay .*\) from the config fields"),
    ({"optimizer": "sgd", "momentum": 0.9, "optimizer_kwargs": {"momentum": 0.5}},
     r"momentum is given twice: optimizer_kwargs\['momentum'\]=0.5 and the field momentum"),
    ({"optimizer": "adamw", "adam_beta1": 0.5, "optimizer_kwargs": {"betas": (0.9, 0.9)}}, "betas is given twice"),
    ({"optimizer": "adagrad", "adam_epsilon": 1e-6}, r"adam_epsilon=1e-06: optimizer='adagrad' .*takes no betas"),
    ({"optimizer": "nadam", "momentum": 0.9}, r"momentum=0.9 is an SGD setting and optimizer='nadam'"),
    ({"optimizer": "adamw_torch_fused", "fused": False}, "fused=False contradicts optimizer='adamw_torch_fused'"),
    ({"optimizer": "rmsprop", "optimizer_kwargs": {"alpha": -1.0}},
     r"optimizer='rmsprop' \(torch.optim.RMSprop\) refused lr=0.001, momentum=0.0, alpha=-1.0: Invalid alpha"),
])
def test_contradictions_and_bad_values_are_one_error_naming_the_optimizer(fields, match):
    with pytest.raises(ll.ConfigError, match=match):
        build_optimizer(Net(), ll.FitConfig(**fields))


def test_hf_names_point_at_the_fields_and_the_cli_reads_a_dict(tmp_path):
    with pytest.raises(ll.ConfigError, match=r"'optim_args' \(did you mean 'optimizer_kwargs'\?"):
        ll.FitConfig(optim_args="momentum=0.9")
    cfg = ll.FitConfig(optimizer="sgd", optimizer_kwargs={"nesterov": True, "momentum": 0.9},
                       lr_scheduler="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1})
    for text in (cfg.to_toml(), cfg.to_json()):  # both come back as they went
        back = ll.FitConfig.from_toml(text) if "=" in text.splitlines()[0] else ll.FitConfig.from_json(text)
        assert back.optimizer_kwargs == cfg.optimizer_kwargs and back.lr_scheduler_kwargs == {"min_lr_rate": 0.1}


def test_a_fit_resumed_with_changed_optimizer_kwargs_steps_with_the_new_ones(tmp_path):
    common = dict(output_dir=str(tmp_path), batch_size=8, optimizer="sgd", momentum=0.9, loggers=[],
                  model_summary=False, save_every=2)
    ll.Fitter(max_steps=2, optimizer_kwargs={"nesterov": True}, **common).fit(Classifier(), DictDataset(32))
    fitter = ll.Fitter(max_steps=3, optimizer_kwargs={"dampening": 0.5}, **common)
    fitter.fit(Classifier(), DictDataset(32), resume=True)
    # the restored groups held nesterov=True, dampening=0: the new config's values replace both
    assert [(g["nesterov"], g["dampening"]) for g in fitter.optimizer.param_groups] == [(False, 0.5)]

"""``use_liger_kernel`` where it cannot run: each reason is one ``ConfigError`` at set-up, before
any step, and the model is left untouched. (On a GPU with liger-kernel: tests/gpu/test_liger_gpu.py.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import Classifier, DictDataset
from torch.utils.data import Dataset

import lightlike as ll
from lightlike.errors import ConfigError
from lightlike.interop.liger import apply_liger, import_liger, liger_model


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))


class Tokens(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        return {"input_ids": torch.arange(i, i + 6) % 64}


class CountSteps(ll.Callback):
    def __init__(self):
        self.steps = 0

    def on_step_start(self, fitter, state, control):
        self.steps += 1


def patched_attributes(model) -> list[str]:
    """Instance attributes that replace a class's method (what a patch of forward sets)."""
    return [f"{name}.{k}" for name, m in model.named_modules() for k in vars(m) if k in ("forward", "extra_repr")]


def test_on_the_cpu_it_is_one_error_naming_cuda_before_any_step(tmp_path):
    from lightlike.interop import HFCausalLM

    model = tiny_llama()
    classes = {name: type(m) for name, m in model.named_modules()}
    counter = CountSteps()
    fitter = ll.Fitter(max_steps=2, batch_size=4, use_liger_kernel=True, liger_kernel_config={"rope": True},
                       output_dir=str(tmp_path), loggers=[], accelerator="cpu", callbacks=[counter])
    with pytest.raises(ConfigError, match="CUDA") as e:
        fitter.fit(HFCausalLM(model), Tokens())
    assert "use_liger_kernel" in str(e.value) and "use_liger_kernel" in e.value.settings
    assert counter.steps == 0 and fitter.state.global_step == 0
    assert patched_attributes(model) == [] and {n: type(m) for n, m in model.named_modules()} == classes


def test_a_module_without_a_transformers_model_is_refused_by_name(tmp_path):
    fitter = ll.Fitter(max_steps=2, batch_size=4, use_liger_kernel=True, output_dir=str(tmp_path), loggers=[],
                       accelerator="cpu")
    with pytest.raises(ConfigError, match="Classifier holds none.*HFCausalLM or HFModel"):
        fitter.fit(Classifier(), DictDataset(n=8))
    assert fitter.state.global_step == 0


def test_a_liger_kernel_config_without_use_liger_kernel_is_an_error_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="use_liger_kernel is False") as e:
        ll.Fitter(max_steps=2, liger_kernel_config={"rope": False}, output_dir=str(tmp_path))
    assert e.value.settings == ("use_liger_kernel", "liger_kernel_config")


def test_the_patched_model_is_the_transformers_model_inside_the_wrapper_and_inside_peft():
    from peft import LoraConfig, get_peft_model

    from lightlike.interop import HFCausalLM

    model = tiny_llama()
    assert liger_model(HFCausalLM(model)) is model
    assert liger_model(model) is model
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert liger_model(HFCausalLM(peft)) is peft.get_base_model()


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_without_liger_kernel_the_error_names_the_extra():
    with pytest.raises(ConfigError, match=r"pip install 'lightlike\[liger\]'"):
        import_liger()

    class OnCuda:  # the one check that needs the device: past it, the missing library is the error
        use_liger_kernel, liger_kernel_config = True, {}

    with pytest.raises(ConfigError, match=r"lightlike\[liger\]"):
        apply_liger(__import__("lightlike.interop", fromlist=["HFCausalLM"]).HFCausalLM(tiny_llama()), OnCuda(), "cuda")

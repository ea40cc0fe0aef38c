"""``use_liger_kernel=True`` on a GPU with liger-kernel (``LIGHTLIKE_TEST_GPU=1 pytest tests/gpu/test_liger_gpu.py``;
skipped without CUDA or liger-kernel: benchmarks/gpu_wheels.sh carries its wheel to a lent GPU).

The same Llama from the same weights, trained by lightlike unpatched and patched (liger-kernel's
own ``_apply_liger_kernel_to_instance``, applied before the strategy wraps the module): per-step
losses equal within bf16 tolerance, and the patched fit's peak memory lower, both for
``HFCausalLM`` (loss from the logits: RoPE, RMSNorm and SwiGLU kernels) and for a module whose
model computes the loss from ``labels`` (liger-kernel's fused linear cross entropy: no logits).
What liger-kernel cannot patch is one error before any step.
"""

from __future__ import annotations

import copy
import gc
import importlib.util

import pytest
import torch
from torch.utils.data import Dataset

import lightlike as ll
from lightlike.errors import ConfigError

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device, left visible by LIGHTLIKE_TEST_GPU=1"),
    pytest.mark.skipif(any(importlib.util.find_spec(name) is None for name in ("liger_kernel", "triton", "transformers")),
                       reason="needs liger-kernel, triton and transformers (benchmarks/gpu_wheels.sh)"),
]

VOCAB, LENGTH, BATCH, STEPS = 32000, 512, 4, 4


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                        max_position_embeddings=LENGTH))


class Tokens(Dataset):
    def __init__(self, n: int = BATCH * STEPS):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def loss_from_labels_module(model):
    """A module whose model computes the mean next-token loss itself from ``labels`` (as under
    the HF Trainer): where liger-kernel's fused linear cross entropy never builds the logits."""
    from lightlike.interop.hf import HFWrapper

    class LossFromLabels(HFWrapper):
        def forward(self, batch):
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

        def loss(self, outputs, batch):
            return outputs

    return LossFromLabels(model)


def fit(module, tmp_path, name, **liger):
    fitter = ll.Fitter(max_steps=STEPS, batch_size=BATCH, precision="bf16-mixed", accelerator="cuda", shuffle=False,
                       learning_rate=1e-4, log_every=1, output_dir=str(tmp_path / name), save_strategy="no",
                       loggers=[], model_summary=False, **liger)
    result = fitter.fit(module, Tokens())
    losses = [row["train/loss"] for row in result.state.log_history if "train/loss" in row]
    peak = result.peak_memory_bytes
    del fitter, result
    module.cpu()
    gc.collect()
    torch.cuda.empty_cache()
    return losses, peak


def test_patched_losses_equal_the_unpatched_within_bf16_and_peak_memory_is_lower(tmp_path):
    """Both forms unpatched first: liger-kernel's apply function also replaces transformers' Llama
    functions and classes for the whole process (RoPE, the RMSNorm and MLP classes), so an
    unpatched run after a patched one would not be unpatched."""
    from transformers.models.llama import modeling_llama

    from lightlike.interop import HFCausalLM

    assert "liger" not in modeling_llama.apply_rotary_pos_emb.__module__, "this process was patched before the test"
    forms = {"HFCausalLM": HFCausalLM, "loss from labels": loss_from_labels_module}
    base = llama()
    plain = {name: wrap(copy.deepcopy(base)) for name, wrap in forms.items()}
    patched = {name: wrap(copy.deepcopy(base)) for name, wrap in forms.items()}
    plain_runs = {name: fit(module, tmp_path, f"plain-{i}") for i, (name, module) in enumerate(plain.items())}
    liger_runs = {name: fit(module, tmp_path, f"liger-{i}", use_liger_kernel=True)
                  for i, (name, module) in enumerate(patched.items())}
    for name in forms:
        (plain_losses, plain_peak), (liger_losses, liger_peak) = plain_runs[name], liger_runs[name]
        print(f"{name}: peak {plain_peak / 2**20:.0f} MiB unpatched, {liger_peak / 2**20:.0f} MiB with Liger; "
              f"losses {plain_losses} / {liger_losses}")
        assert len(plain_losses) == len(liger_losses) == STEPS
        # same weights, same batches: the kernels compute the same function in another order (bf16: ~3 digits)
        torch.testing.assert_close(torch.tensor(liger_losses), torch.tensor(plain_losses), rtol=2e-2, atol=0)
        assert liger_peak < plain_peak, name
        # liger-kernel patched this instance (its RMSNorm's forward bound on the module), not the other
        assert "forward" in vars(patched[name].model.model.layers[0].input_layernorm)
        assert "forward" not in vars(plain[name].model.model.layers[0].input_layernorm)


def test_what_liger_kernel_cannot_patch_is_one_error_before_any_step(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightlike.interop import HFCausalLM

    gpt2 = HFCausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=LENGTH)))
    for module, liger_config, match in [(gpt2, {}, "no kernels for model type 'gpt2'"),
                                        (HFCausalLM(llama()), {"rms_norms": True}, r"\['rms_norms'\] are not arguments")]:
        fitter = ll.Fitter(max_steps=2, batch_size=BATCH, accelerator="cuda", output_dir=str(tmp_path / "bad"),
                           overwrite_output_dir=True, loggers=[], use_liger_kernel=True, liger_kernel_config=liger_config)
        with pytest.raises(ConfigError, match=match):
            fitter.fit(module, Tokens(n=4))
        assert fitter.state.global_step == 0

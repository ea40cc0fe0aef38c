"""Liger kernels (``use_liger_kernel=True``) against the unpatched model: peak memory and step time.

The same Llama from the same weights is trained by lightlike (bf16-mixed, one GPU) for
``--steps`` steps, unpatched and then patched with liger-kernel's kernels, in two module
forms: ``HFCausalLM`` (lightlike computes the token loss from the logits: liger-kernel's RoPE,
RMSNorm and SwiGLU kernels act) and a module whose model computes the loss from ``labels``
(``labels``: liger-kernel's fused linear cross entropy too, which never builds the logits).
Printed per form: peak memory (``FitResult.peak_memory_bytes``) and the median step time after
``--warmup`` steps (Triton compiles its kernels in the first ones), and the patched/unpatched
ratios. The unpatched fits run first (liger-kernel's apply function also replaces transformers'
Llama functions and classes for the whole process): what they leave allocated counts against Liger.

    python benchmarks/liger.py                    # on a GPU with liger-kernel (benchmarks/gpu_wheels.sh)
    python benchmarks/liger.py --tiny             # on the CPU: the unpatched rows, and Liger's set-up error
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time

import torch
from torch.utils.data import Dataset

import lightlike as ll
from lightlike.errors import ConfigError
from lightlike.interop import HFCausalLM
from lightlike.interop.hf import HFWrapper


class Tokens(Dataset):
    def __init__(self, n: int, length: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class LossFromLabels(HFWrapper):
    """The model computes the mean next-token loss from ``labels`` (the HF Trainer's way)."""

    def forward(self, batch):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

    def loss(self, outputs, batch):
        return outputs


class StepClock(ll.Callback):
    """Each step's wall time (the device synchronised at each end)."""

    def __init__(self, device: str):
        self.device, self.times, self.last = device, [], None

    def on_step_start(self, fitter, state, control):
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.last = time.perf_counter()

    def on_step_end(self, fitter, state, control):
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.last)


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                                        num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.length))


def one_fit(module, args, device: str, **liger) -> tuple[float, float, float]:
    """(peak MiB, median s/step after the warmup, last logged loss)."""
    clock = StepClock(device)
    with tempfile.TemporaryDirectory() as out:
        fitter = ll.Fitter(max_steps=args.steps, batch_size=args.batch, accelerator=device, shuffle=False,
                           precision="bf16-mixed" if device == "cuda" else "32-true", learning_rate=1e-4,
                           log_every=args.steps, output_dir=out, save_strategy="no", loggers=[], model_summary=False,
                           callbacks=[clock], **liger)
        result = fitter.fit(module, Tokens(args.batch * args.steps, args.length, args.vocab))
    peak = (result.peak_memory_bytes or 0) / 2**20
    loss = result.metrics["train/loss"]
    del fitter, result
    module.cpu()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return peak, statistics.median(clock.times[args.warmup:] or clock.times), loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the script's own check)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)  # Llama 3's: where the logits dominate the memory
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.batch, args.length, args.vocab, args.hidden, args.layers = 3, 1, 2, 16, 64, 64, 2
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    base = llama(args)
    print(f"Llama {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M params, vocab {args.vocab}, batch {args.batch} "
          f"x {args.length} tokens, {args.steps} steps ({args.warmup} warmup), {device}")
    forms = {"HFCausalLM": HFCausalLM, "loss from labels": LossFromLabels}
    # every unpatched run first: liger-kernel also patches transformers' Llama code for the process
    plain = {name: one_fit(wrap(copy.deepcopy(base)), args, device) for name, wrap in forms.items()}
    for name, wrap in forms.items():
        print(f"{name:17s} unpatched: peak {plain[name][0]:8.0f} MiB  {plain[name][1] * 1e3:8.1f} ms/step  "
              f"loss {plain[name][2]:.4f}")
        try:
            liger = one_fit(wrap(copy.deepcopy(base)), args, device, use_liger_kernel=True)
        except ConfigError as error:
            print(f"{name:17s} liger: not run: {error}")
            continue
        print(f"{name:17s} liger:     peak {liger[0]:8.0f} MiB  {liger[1] * 1e3:8.1f} ms/step  loss {liger[2]:.4f}")
        print(f"{name:17s} liger/unpatched: peak memory {liger[0] / plain[name][0]:.3f}, "
              f"step time {liger[1] / plain[name][1]:.3f}")


if __name__ == "__main__":
    main()

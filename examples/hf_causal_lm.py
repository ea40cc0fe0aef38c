"""Train a Hugging Face ``transformers`` causal LM with lightlike, then export it for
``from_pretrained``.

A small GPT-2 (built from a config: nothing is downloaded) learns byte-level Python from the
standard library's own sources, which are on every machine that has Python. Groups of lines
are variable-length sequences, right-padded; padding is labelled -100 and does not count, and
``HFCausalLM.num_items`` counts the tokens that do, so the loss and gradient accumulation are
exact over tokens (however the padding falls across micro-batches and processes). At the end the checkpoint is exported as an HF folder and loaded back
with ``AutoModelForCausalLM.from_pretrained``.

    pip install transformers
    python examples/hf_causal_lm.py                 # a couple of minutes on a CPU
    python examples/hf_causal_lm.py --tiny          # a few seconds: what the tests run
    python examples/hf_causal_lm.py --resume        # after a kill: continue from the newest checkpoint
    torchrun --nproc_per_node 2 examples/hf_causal_lm.py
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

import lightlike as ll
from lightlike.interop.hf import HFCausalLM, export_hf

PAD, BOS = 0, 1  # byte values 0 and 1 never occur in the sources: free for special tokens


class SourceLines(Dataset):
    """Groups of consecutive lines of the standard library's ``.py`` files, as bytes (token =
    byte value), BOS first, right-padded to ``max_len``: ``input_ids``, ``attention_mask`` and
    ``labels`` (-100 on padding)."""

    def __init__(self, files: list[Path], max_len: int, limit: int):
        self.max_len = max_len
        self.items: list[torch.Tensor] = []
        for path in files:
            chunk = b""
            for line in path.read_bytes().splitlines(keepends=True):
                if len(chunk) + len(line) + 1 > max_len:
                    if chunk.strip():
                        self.items.append(torch.tensor([BOS, *chunk]))
                    chunk = b""
                chunk += line[: max_len - 1]
            if len(self.items) >= limit:
                break
        self.items = self.items[:limit]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.items[i]
        ids = torch.full((self.max_len,), PAD, dtype=torch.long)
        ids[: len(x)] = x
        mask = (torch.arange(self.max_len) < len(x)).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_model(tiny: bool):
    from transformers import AutoModelForCausalLM, GPT2Config

    size = dict(n_layer=1, n_embd=32, n_head=2) if tiny else dict(n_layer=2, n_embd=96, n_head=4)
    config = GPT2Config(vocab_size=256, n_positions=128, bos_token_id=BOS, eos_token_id=BOS, pad_token_id=PAD,
                        **size)
    return AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum-steps", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--output-dir", default="runs/hf_causal_lm")
    p.add_argument("--tiny", action="store_true", help="a tiny model on tiny data for a few steps (tests)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --output-dir")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its newest checkpoint (or start it, if it has none)")
    args = p.parse_args(argv)
    if args.tiny:
        args.max_steps, args.batch_size = 8, 4

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.glob("*.py") if not f.name.startswith("_"))
    n_train, n_val = (64, 16) if args.tiny else (20000, 1000)
    train = SourceLines(files[1::2], max_len=128, limit=n_train)
    val = SourceLines(files[::2], max_len=128, limit=n_val)  # other files: never seen in training

    fitter = ll.Fitter(max_steps=args.max_steps, batch_size=args.batch_size, grad_accum_steps=args.grad_accum_steps,
                       learning_rate=args.learning_rate, warmup_ratio=0.05, weight_decay=0.1, max_grad_norm=1.0,
                       eval_every=max(1, args.max_steps // 4), log_every=max(1, args.max_steps // 20),
                       save_every=max(1, args.max_steps // 4), save_total_limit=2, output_dir=args.output_dir,
                       overwrite_output_dir=args.overwrite, seed=0)
    module = HFCausalLM(build_model(args.tiny))  # built after the Fitter: seeded, the same every run
    # datasets: the Fitter builds resumable, rank-aware loaders; "auto": the newest valid checkpoint,
    # or a fresh start when a run was killed before its first save
    result = fitter.fit(module, train, val, resume="auto" if args.resume else None)
    loss = result.metrics["val/loss"]
    if not fitter.strategy.is_global_zero:
        return
    print(f"final val loss: {loss:.4f} nats/byte  perplexity: {math.exp(loss):.2f}  "
          f"next-byte accuracy: {result.metrics['val/accuracy']:.3f}")

    out = Path(args.output_dir) / "hf"
    export_hf(Path(args.output_dir) / f"checkpoint-{result.global_step}", out)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    prompt = torch.tensor([[BOS, *b"def "]])
    sample = loaded.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    print(f"exported to {out}; greedy sample from the reloaded model:")
    print(bytes(sample[0, 1:].tolist()).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    try:
        main()
    except ll.OutputDirError as error:  # a second run into the same folder: say this script's flags
        sys.exit(f"{error}\n(with this example: --resume to continue it, --overwrite to replace it, "
                 "or --output-dir DIR)")

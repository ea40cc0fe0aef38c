"""Train a small character-level GPT on the Python standard library's own sources.

The data is on every machine that has Python: a deterministic, sorted selection of the
standard library's top-level ``.py`` files (a few MB), with some whole files held out for
validation. On two CPU cores the default run takes a few minutes; the eval loss falls from
ln(vocab) ~ 4.6 nats to well under 2, and the model writes plausible-looking Python at the end.

    python examples/char_gpt.py                        # the default run
    python examples/char_gpt.py --max-steps 3000       # longer
    python examples/char_gpt.py --tiny                 # a few seconds: what the tests run
    tensorboard --logdir runs/char_gpt/logs            # watch it
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import lightlike as ll

UNK = "\ufffd"  # index 0: every character the vocabulary does not know


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def stdlib_sources(train_chars: int, val_chars: int, val_every: int = 10) -> tuple[str, str]:
    """The standard library's top-level ``.py`` files, sorted by name: every ``val_every``-th
    file goes to validation (up to ``val_chars``), the rest to training (up to ``train_chars``).
    Whole files only, so no validation text is ever seen in training."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_sysconfigdata"))
    if not files:
        raise SystemExit(f"no .py files found in the standard library folder {stdlib}")
    train: list[str] = []
    val: list[str] = []
    n_train = n_val = 0
    for i, path in enumerate(files):
        if n_train >= train_chars and n_val >= val_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        if i % val_every == val_every // 2:
            if n_val < val_chars:
                val.append(text)
                n_val += len(text)
        elif n_train < train_chars:
            train.append(text)
            n_train += len(text)
    return "".join(train)[:train_chars], "".join(val)[:val_chars]


class CharVocab:
    """Characters seen at least ``min_count`` times in the training text; index 0 is <unk>."""

    def __init__(self, chars: str):
        self.chars = chars  # chars[0] is UNK
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def build(cls, text: str, min_count: int = 1) -> CharVocab:
        counts = Counter(text)
        return cls(UNK + "".join(sorted(c for c, n in counts.items() if n >= min_count and c != UNK)))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        get = self.index.get
        return torch.tensor([get(c, 0) for c in text], dtype=torch.long)

    def decode(self, idx: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[i] for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx))


class CharWindows(Dataset):
    """Fixed-length windows at deterministic offsets ``0, stride, 2*stride, ...``: item ``i`` is
    ``idx = data[s:s+T]`` and ``targets = data[s+1:s+T+1]`` with ``s = i*stride``."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None):
        self.data, self.block_size = data, block_size
        self.stride = stride or block_size
        self.n = max(0, (len(data) - 1 - block_size) // self.stride + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = i * self.stride
        chunk = self.data[s : s + self.block_size + 1]
        return {"idx": chunk[:-1], "targets": chunk[1:]}


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # torch's bfloat16 flash-attention backward on CPU is ~2x slower than float32's:
            # attend in float32 there (the matmuls around it stay in bfloat16)
            with torch.autocast("cpu", enabled=False):
                y = self._attend(q.float(), k.float(), v.float()).to(q.dtype)
        else:
            y = self._attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(ll.TaskModule):
    """A small GPT over characters. Batches are ``{"idx": (B, T) long, "targets": (B, T) long}``."""

    def __init__(self, vocab_size: int, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = self.maybe_checkpoint(block, x)  # activation checkpointing when it is switched on
        return self.head(self.ln_f(x))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.logits(batch["idx"])

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1).float(), batch["targets"].flatten())

    def num_items(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["targets"].numel()  # the loss is a mean over tokens, not sequences

    def metrics(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss = self.loss(outputs, batch).detach()
        accuracy = (outputs.argmax(-1) == batch["targets"]).float().mean()
        return {"accuracy": accuracy, "bits_per_char": loss / math.log(2)}

    @torch.no_grad()
    def generate(self, prompt_idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` characters after ``prompt_idx`` ((T,) or (B, T)); returns the
        prompt followed by them. ``temperature=0`` is greedy decoding."""
        was_training = self.training
        self.eval()
        idx = prompt_idx.unsqueeze(0) if prompt_idx.ndim == 1 else prompt_idx
        idx = idx.to(self.tok_emb.weight.device)
        try:
            for _ in range(max_new_tokens):
                logits = self.logits(idx[:, -self.block_size :])[:, -1, :].float()
                if temperature <= 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None and top_k < logits.shape[-1]:
                        kth = torch.topk(logits, top_k).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx[0] if prompt_idx.ndim == 1 else idx


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
class PrintEvaluations(ll.Callback):
    """Print each evaluation as it happens when there is no progress bar to show it (output
    redirected to a file or a CI log), so a run of several minutes is never silent."""

    def on_fit_start(self, fitter, state, control):
        self.start = time.perf_counter()

    def on_evaluate(self, fitter, state, control, metrics):
        if not sys.stderr.isatty():
            print(f"step {state.global_step:>5}/{state.max_steps}  val/loss {metrics['val/loss']:.4f}  "
                  f"val/accuracy {metrics['val/accuracy']:.3f}  ({time.perf_counter() - self.start:.0f} s)",
                  flush=True)


def default_precision() -> str:
    """``bf16-mixed`` where bfloat16 matmuls are fast, else ``32-true``. On a CPU with AVX-512 it
    trains this model ~1.3x faster than fp32; on CPUs without, bfloat16 is emulated and slower."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    try:
        return "bf16-mixed" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "32-true"
    except (AttributeError, RuntimeError):
        return "32-true"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=1500, help="optimizer steps (default: 1500)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per batch (default: 32)")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--output-dir", default="runs/char_gpt", help="checkpoints and logs (default: runs/char_gpt)")
    p.add_argument("--precision", default=None,
                   help="'bf16-mixed', '32-true', ... (default: bf16-mixed where bfloat16 is fast, "
                        "i.e. CUDA with bf16 or a CPU with AVX-512/AMX; else 32-true)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny model on tiny data for a few steps (tests)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --output-dir")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir from its newest checkpoint (or start it, if it has none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> ll.FitResult:
    args = parse_args(argv)
    precision = args.precision or default_precision()
    if args.tiny:
        model_cfg = dict(block_size=32, n_layer=1, n_head=2, n_embd=32)
        train_chars, val_chars, min_count = 40_000, 8_000, 1
        max_steps, batch_size, every, log_every = 6, 8, 3, 1
    else:
        model_cfg = dict(block_size=128, n_layer=4, n_head=4, n_embd=128)
        train_chars, val_chars, min_count = 3_000_000, 200_000, 5
        max_steps, batch_size = args.max_steps, args.batch_size
        every, log_every = max(1, min(250, max_steps // 4)), 25

    train_text, val_text = stdlib_sources(train_chars, val_chars)
    vocab = CharVocab.build(train_text, min_count=min_count)
    train_data = CharWindows(vocab.encode(train_text), model_cfg["block_size"])
    val_data = CharWindows(vocab.encode(val_text), model_cfg["block_size"])
    print(f"data: {len(train_text):,} training / {len(val_text):,} validation characters of the standard "
          f"library, vocabulary {len(vocab)} (ln V = {math.log(len(vocab)):.2f}), "
          f"{len(train_data):,} / {len(val_data):,} windows of {model_cfg['block_size']}; "
          f"precision {precision}, {torch.get_num_threads()} CPU threads")

    ll.seed_everything(args.seed)  # fit() seeds too, but only after the weights are initialised here
    module = CharGPT(len(vocab), **model_cfg)
    fitter = ll.Fitter(
        max_steps=max_steps,
        batch_size=batch_size,
        eval_batch_size=2 * batch_size,
        learning_rate=args.learning_rate,
        weight_decay=0.1,
        adam_beta2=0.99,
        lr_scheduler="cosine",
        warmup_steps=max(1, max_steps // 20),
        max_grad_norm=1.0,
        precision=precision,
        eval_every=every,
        save_every=every,
        save_total_limit=2,
        log_every=log_every,
        output_dir=args.output_dir,
        overwrite_output_dir=args.overwrite,
        seed=args.seed,
        callbacks=[PrintEvaluations()],
    )
    start = time.perf_counter()
    # "auto": the newest valid checkpoint, or a fresh start when a run was killed before its first
    # save (what it left is moved aside), so the same command continues a run whatever happened
    result = fitter.fit(module, train_data, val_data, resume="auto" if args.resume else None)
    elapsed = time.perf_counter() - start

    out = Path(args.output_dir)
    (out / "vocab.json").write_text(json.dumps({"chars": vocab.chars}) + "\n")
    began = ll.FitState.saved_in(fitter.resumed_from).global_step if fitter.resumed_from else 0
    if result.global_step == began:
        print(f"\nnothing left to train: {fitter.resumed_from} is at step {began}, this run's last")
    else:
        print(f"\ntrained {result.global_step - began} steps in {elapsed:.0f} s"
              + (f" (steps {began + 1} to {result.global_step}, resumed at step {began})" if began else "")
              + f" ({result.samples_per_second * model_cfg['block_size']:,.0f} tokens/s)")
    val_loss = result.metrics["val/loss"]
    print(f"final val loss: {val_loss:.4f} ({result.metrics['val/bits_per_char']:.3f} bits/char, "
          f"accuracy {result.metrics['val/accuracy']:.3f}); training loss (whole fit): "
          f"{result.training_loss:.4f}")

    prompt = "def "
    g = torch.Generator().manual_seed(args.seed)
    sample = module.generate(vocab.encode(prompt), 60 if args.tiny else 300, temperature=0.8, top_k=20,
                             generator=g)
    print(f"\nsample:\n{'-' * 72}\n{vocab.decode(sample)}\n{'-' * 72}")
    print(f"checkpoint: {out / f'checkpoint-{result.global_step}'}")
    print(f"TensorBoard logs: {out / 'logs'}   (tensorboard --logdir {out / 'logs'})")
    return result


if __name__ == "__main__":
    try:
        main()
    except ll.OutputDirError as error:  # a second run into the same folder: say this script's flags
        sys.exit(f"{error}\n(with this example: --resume to continue it, --overwrite to replace it, "
                 "or --output-dir DIR)")

"""The same GPT-style model trained by four drivers, side by side: ms/step, tokens/s, MFU, peak memory.

Drivers, each in a process of its own (so that each one's peak memory and compile caches are its
own): a hand-written loop (``gpt_throughput.hand_written``: the model ``torch.compile``d, the
loss eager after it), lightlike's ``Fitter`` (``compile=True``: forward and loss one compiled
function; ``lightlike-regions``: ``compile_regions=True``), the Lightning ``Trainer`` (the model
compiled inside a ``LightningModule``) and the Hugging Face ``Trainer`` (``torch_compile=True``
on a model whose forward returns the loss). The model is ``examples/char_gpt.py``'s CharGPT
(pre-norm blocks, tied embedding, the loss an fp32 upcast of the logits and a cross-entropy),
on random tokens, with the same work everywhere: fused AdamW (lr 3e-4, no weight decay), a linear
schedule, no clipping, shuffled batches, ``bf16-mixed`` on CUDA (fp32 on the CPU).

MFU counts ``6 * N + 12 * n_layer * n_embd * T`` FLOPs per token (``gpt_throughput.py``) against
``--peak-tflops`` (H100/H200 SXM: 989). Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA,
the process's peak resident set on the CPU. Lightning and transformers are imported only here, in
their drivers' processes; a driver whose package is missing is skipped with a note.

    python benchmarks/gpt_peers.py                      # GPT-2 small shape (124 M), every driver
    python benchmarks/gpt_peers.py --preset 0.9b        # issue 33's model: 16 x 2048, 2048 tokens
    python benchmarks/gpt_peers.py --tiny               # CPU smoke run
    python benchmarks/gpt_peers.py --drivers hand,lightlike
    python benchmarks/gpt_peers.py --drivers lightlike,lightlike-regions --ac   # per-block checkpointing
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVERS = ("hand", "lightlike", "lightlike-regions", "lightning", "hf")
DEFAULT_DRIVERS = "hand,lightlike,lightning,hf"
PRESETS = {  # n_layer, n_embd, n_head, block, vocab, batch
    "gpt2": (12, 768, 12, 1024, 50304, 8),
    "0.9b": (16, 2048, 16, 2048, 50304, 8),
    "tiny": (2, 64, 2, 64, 256, 4),
}


# ---- one driver, in its own process ---------------------------------------------------------------
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock:
    """Wall time of steps warmup+1..steps, the device synchronised at both ends."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps, self.t0, self.t1 = warmup, steps, 0.0, 0.0

    def at(self, step: int) -> None:
        if step == self.warmup:
            _sync()
            self.t0 = time.perf_counter()
        elif step == self.steps:
            _sync()
            self.t1 = time.perf_counter()

    def ms_per_step(self) -> float:
        return (self.t1 - self.t0) / (self.steps - self.warmup) * 1e3


def run_driver(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, HERE)
    import torch
    from gpt_throughput import RandomTokens, _model

    cuda = torch.cuda.is_available()
    data = RandomTokens(args.batch_size * args.steps * 2, args.block, args.vocab)
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in _model(args).parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    extra: dict[str, Any] = {}
    if args.driver == "hand":
        from gpt_throughput import hand_written

        ms = hand_written(args, data, cuda, shard=False) * 1e3
    elif args.driver.startswith("lightlike"):
        ms, extra = _lightlike(args, data, cuda)
    elif args.driver == "lightning":
        ms = _lightning(args, data, cuda)
    else:
        ms = _hf(args, data, cuda)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tok_s = args.batch_size * args.block / (ms / 1e3)
    result = {"driver": args.driver, "ms_per_step": ms, "tokens_per_s": tok_s, "peak_bytes": peak,
              "compiled": args.compile and (cuda or args.compile_cpu),
              "params": n_params, "device": torch.cuda.get_device_name() if cuda else "CPU", **extra}
    flops_per_token = 6 * n_params + 12 * args.n_layer * args.n_embd * args.block
    peak_tflops = args.peak_tflops or _peak_tflops(result["device"])
    if cuda and peak_tflops:
        result["mfu"] = flops_per_token * tok_s / (peak_tflops * 1e12)
    return result


def _peak_tflops(device: str) -> float | None:
    from gpt_throughput import PEAK_TFLOPS

    return next((v for k, v in PEAK_TFLOPS.items() if k in device), None)


def _lightlike(args: argparse.Namespace, data: Any, cuda: bool) -> tuple[float, dict[str, Any]]:
    import torch
    from gpt_throughput import _model

    import lightlike as ll
    from lightlike.strategies import SingleDeviceStrategy

    clock = Clock(args.warmup, args.steps)

    class Timed(ll.Callback):
        def on_step_end(self, fitter, state, control):
            clock.at(state.global_step)

    torch.manual_seed(0)
    model = _model(args)
    compiled = args.compile and (cuda or args.compile_cpu)
    strategy = SingleDeviceStrategy(activation_checkpointing=True) if args.ac else "auto"
    with tempfile.TemporaryDirectory() as out:
        result = ll.Fitter(precision="bf16-mixed" if cuda else "32-true", compile=compiled, strategy=strategy,
                           compile_regions=compiled and args.driver == "lightlike-regions",
                           compile_mode=args.compile_mode if compiled else None,
                           max_steps=args.steps, batch_size=args.batch_size, learning_rate=3e-4, output_dir=out,
                           loggers=[], progress_bar=False, model_summary=False, log_level="warning",
                           save_strategy="no", callbacks=[Timed()]).fit(model, data)
    return clock.ms_per_step(), {"compile_seconds": result.compile_seconds}


def _lightning(args: argparse.Namespace, data: Any, cuda: bool) -> float:
    import torch
    from gpt_throughput import _model

    try:
        import lightning as L  # noqa: N812 (Lightning's own name for it)
    except ImportError:
        import pytorch_lightning as L  # noqa: N812

    clock = Clock(args.warmup, args.steps)
    compiled = args.compile and (cuda or args.compile_cpu)

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = _model(args)
            self.run = torch.compile(self.gpt) if compiled else self.gpt

        def training_step(self, batch, batch_idx):
            return self.gpt.loss(self.run(batch), batch)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.0, fused=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / args.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Timed(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.at(trainer.global_step)

    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    trainer = L.Trainer(max_steps=args.steps, accelerator="gpu" if cuda else "cpu", devices=1,
                        precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timed()],
                        default_root_dir=tempfile.mkdtemp())
    trainer.fit(GPT(), loader)
    return clock.ms_per_step()


def _hf(args: argparse.Namespace, data: Any, cuda: bool) -> float:
    import torch
    from gpt_throughput import _model
    from torch import nn
    from transformers import Trainer, TrainerCallback, TrainingArguments

    clock = Clock(args.warmup, args.steps)
    compiled = args.compile and (cuda or args.compile_cpu)

    class WithLoss(nn.Module):
        """The HF way: the model's forward returns the loss (so torch_compile compiles it too)."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = _model(args)

        def forward(self, idx, targets):
            batch = {"idx": idx, "targets": targets}
            return {"loss": self.gpt.loss(self.gpt(batch), batch)}

    class Timed(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            clock.at(state.global_step)

    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=3e-4, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=0.0,
        optim="adamw_torch_fused", bf16=cuda, use_cpu=not cuda, torch_compile=compiled, logging_steps=10**6,
        save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, seed=0)
    Trainer(model=WithLoss(), args=targs, train_dataset=data, callbacks=[Timed()]).train()
    return clock.ms_per_step()


# ---- the side-by-side table -----------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drivers", default=DEFAULT_DRIVERS, help=f"comma-separated, of {', '.join(DRIVERS)}")
    p.add_argument("--preset", default="gpt2", choices=sorted(PRESETS))
    p.add_argument("--tiny", action="store_true", help="--preset tiny and few steps (a CPU smoke run)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--no-compile", action="store_true", help="no torch.compile anywhere (on CUDA it is on)")
    p.add_argument("--compile-cpu", action="store_true", help="torch.compile on the CPU too")
    p.add_argument("--ac", action="store_true", help="lightlike drivers: per-block activation checkpointing "
                   "(SingleDeviceStrategy(activation_checkpointing=True)), compiled with the step or each block")
    p.add_argument("--compile-mode", default=None, help="lightlike drivers: compile_mode (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each driver may take")
    p.add_argument("--driver", help=argparse.SUPPRESS)  # internal: run one driver, print its result
    args = p.parse_args()
    if args.tiny:
        args.preset = "tiny"
        if args.steps == p.get_default("steps"):
            args.steps, args.warmup = 8, 3
    n_layer, n_embd, n_head, block, vocab, batch = PRESETS[args.preset]
    args.n_layer, args.n_embd, args.n_head, args.block, args.vocab = n_layer, n_embd, n_head, block, vocab
    args.batch_size = args.batch_size or batch
    args.compile, args.no_hand = not args.no_compile, False
    if args.driver:
        print("RESULT " + json.dumps(run_driver(args)), flush=True)
        return
    drivers = args.drivers.split(",")
    unknown = [d for d in drivers if d not in DRIVERS]
    if unknown:
        raise SystemExit(f"unknown driver(s) {unknown}; drivers: {', '.join(DRIVERS)}")
    rows = 0
    for driver in drivers:  # each row printed as its driver ends: a run cut short keeps the rows it has
        row = _launch(driver, sys.argv[1:], args.timeout)
        if row is not None:
            _print_row(args, row, header=rows == 0)
            rows += 1
    if not rows:
        print("no driver ran")


def _launch(driver: str, argv: list[str], timeout: float) -> dict[str, Any] | None:
    """Run one driver in a process of its own; None (with a note) where it is missing or fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--driver", driver],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"note: {driver} did not finish within {timeout:.0f} s: skipped", flush=True)
        return None
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        missing = "ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr
        print(f"note: {driver} {'is not installed here' if missing else 'failed'}: skipped ({tail[0]})", flush=True)
        return None
    result = json.loads(found[-1][len("RESULT "):])
    result["process_seconds"] = time.perf_counter() - start
    return result


def _print_row(args: argparse.Namespace, r: dict[str, Any], header: bool) -> None:
    """One driver's row of the markdown table (after the table's header, for the first)."""
    if header:
        print(f"{r['device']}, {r['params'] / 1e6:.1f} M parameters, batch {args.batch_size} x {args.block} "
              f"tokens, {args.steps - args.warmup} timed steps after {args.warmup}, "
              f"{'compiled' if r['compiled'] else 'not compiled'}")
        memory = "peak memory" if r["device"] != "CPU" else "peak RSS"
        print(f"| driver | ms/step | tokens/s | MFU | {memory} | process s |")
        print("|---|---|---|---|---|---|")
    mfu = f"{100 * r['mfu']:.1f} %" if "mfu" in r else "-"
    name = r["driver"] + (" + ac" if args.ac and r["driver"].startswith("lightlike") else "") + (f" (compile {r['compile_seconds']:.1f} s)" if r.get("compile_seconds") else "")
    print(f"| {name} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | {mfu} | "
          f"{r['peak_bytes'] / 2**30:.2f} GiB | {r['process_seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""Tokens/s and MFU of a GPT-style model through the Fitter: one device, or FSDP under torchrun.

The model is ``examples/char_gpt.py``'s CharGPT (pre-norm blocks, tied embedding), trained on
random tokens with ``precision="bf16-mixed"`` and ``compile=True`` (on CUDA). MFU counts the
model FLOPs of a training step as ``6 * N + 12 * n_layer * n_embd * T`` per token (PaLM's
formula: matmuls forward and backward, plus attention) against the device's peak dense bf16
FLOP/s (``--peak-tflops``; H100/H200 SXM: 989).

    python benchmarks/gpt_throughput.py                                  # one device, and the hand loop
    torchrun --nproc_per_node 8 benchmarks/gpt_throughput.py --strategy fsdp
    python benchmarks/gpt_throughput.py --tiny                           # CPU smoke run

On a machine without CUDA it runs on the CPU in fp32 (no MFU is reported).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from char_gpt import CharGPT  # noqa: E402

import lightlike as ll  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


class RandomTokens(Dataset):
    def __init__(self, n: int, block: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, block + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        row = self.data[i]
        return {"idx": row[:-1], "targets": row[1:]}


class Throughput(ll.Callback):
    """Times steps warmup+1..last (the device synchronised at both ends): the fit's end, which
    may write a checkpoint, is outside the window."""

    def __init__(self, warmup: int):
        self.warmup, self.t0, self.t1, self.steps = warmup, 0.0, 0.0, 0

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.warmup:
            _sync()
            self.t0 = time.perf_counter()
        elif state.global_step == state.max_steps:
            _sync()
            self.t1 = time.perf_counter()
            self.steps = state.global_step - self.warmup


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hand_written(args: argparse.Namespace, data: Dataset, cuda: bool, shard: bool) -> float:
    """The same work written by hand: the model, fused AdamW (no weight decay: the Fitter's
    default) with a linear schedule, bf16 autocast and ``torch.compile`` on CUDA, shuffled
    batches; with ``shard``,
    FSDP2 as the Fitter's ``fsdp`` sets it up (``fully_shard`` on each block, then the root
    without resharding after forward; parameters gathered in bf16, gradients reduced in fp32).
    Seconds over steps warmup+1..steps."""
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    torch.manual_seed(0)
    model = _model(args).to(device)
    if shard:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
            MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=True)  # as the Fitter
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / args.steps))
    run = torch.compile(model) if (cuda or getattr(args, "compile_cpu", False)) and not args.no_compile else model
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    step, t0 = 0, 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model.loss(run(batch), batch)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == args.warmup:
            _sync()
            t0 = time.perf_counter()
        if step == args.steps:
            _sync()
            break
    return (time.perf_counter() - t0) / (args.steps - args.warmup)


def _process_group(cuda: bool) -> bool:
    """Start torchrun's process group for the hand-written FSDP loop (the Fitter then uses it);
    True when started here."""
    import torch.distributed as dist

    if dist.is_initialized() or "RANK" not in os.environ:
        return False
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def _model(args: argparse.Namespace) -> CharGPT:
    return CharGPT(args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a small model and few steps (a smoke run)")
    p.add_argument("--no-hand", action="store_true",
                   help="skip the hand-written loop (written for one device, and for 'fsdp')")
    args = p.parse_args()
    if args.tiny:
        args.n_layer, args.n_embd, args.n_head, args.block, args.vocab = 2, 64, 2, 64, 256
        args.batch_size = 4
        if args.steps == p.get_default("steps"):
            args.steps, args.warmup = 8, 3
    cuda = torch.cuda.is_available()
    data = RandomTokens(args.batch_size * args.steps * 8, args.block, args.vocab)
    shard = args.strategy == "fsdp"
    started = _process_group(cuda) if shard else False
    mine = args.strategy in ("auto", "single") and int(os.environ.get("WORLD_SIZE", "1")) == 1
    hand = [hand_written(args, data, cuda, shard)] if (shard or mine) and not args.no_hand else []
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # the Fitter's peak, not the hand loop's
    torch.manual_seed(0)
    model = _model(args)
    n_params = sum(p.numel() for p in model.parameters())
    clock = Throughput(args.warmup)
    with tempfile.TemporaryDirectory() as out:
        fitter = ll.Fitter(strategy=args.strategy, precision="bf16-mixed" if cuda else "32-true",
                           compile=cuda and not args.no_compile, max_steps=args.steps, batch_size=args.batch_size,
                           learning_rate=3e-4, output_dir=out, loggers=[], progress_bar=False,
                           model_summary=False, log_level="warning", callbacks=[clock])
        fitter.fit(model, data)
    if hand:  # once before the Fitter and once after: the second loop of a process runs faster
        hand.append(hand_written(args, data, cuda, shard))
    strategy = fitter.strategy
    world = strategy.world_size
    tokens = clock.steps * args.batch_size * args.block * world
    tok_s = tokens / (clock.t1 - clock.t0)
    flops_per_token = 6 * n_params + 12 * args.n_layer * args.n_embd * args.block
    if strategy.is_global_zero:
        device = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"{device} x {world}, strategy {strategy.name}, {n_params / 1e6:.1f} M parameters, "
              f"batch {args.batch_size} x {args.block} tokens per rank, {clock.steps} timed steps")
        print(f"tokens/s: {tok_s:,.0f} ({tok_s / world:,.0f} per device)")
        if hand:
            fit_step, mean = (clock.t1 - clock.t0) / clock.steps, sum(hand) / len(hand)
            print(f"step: Fitter {fit_step * 1e3:.2f} ms, hand-written{' FSDP2' if shard else ''} {mean * 1e3:.2f} ms "
                  f"(before {hand[0] * 1e3:.2f}, after {hand[1] * 1e3:.2f}): fitter / hand {fit_step / mean:.3f}")
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
        if cuda and peak:
            mfu = flops_per_token * tok_s / world / (peak * 1e12)
            print(f"MFU: {100 * mfu:.1f} % of {peak:.0f} TFLOP/s bf16 per device; "
                  f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if started:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

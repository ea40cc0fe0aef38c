"""A script the DDP tests launch with torchrun (or plain python for one process).

    torchrun --nproc_per_node 2 ddp_target.py OUT --mode train|eval|fail [options] [--then OUT2 [options] ...]

``--then`` starts another run in the same launch (the same processes and process group), into
its own OUT: each run as a launch of its own would do it (``each``). A launch costs more than
the short runs here (torchrun, the imports, the group's start), so the tests launch several
runs that need no fresh process at once (never a kill, a signal or a failure before the last).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import EMA, Classifier, DictDataset, KeepsEMA, TokenClassifier  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.utils.memory import memory_footprint  # noqa: E402


class StopAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True


class FailAt(ll.Callback):
    def __init__(self, rank, step, phase):
        self.rank, self.step, self.phase = rank, step, phase

    def on_step_end(self, fitter, state, control):
        if self.phase == "train" and fitter.strategy.global_rank == self.rank and state.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if self.phase == "first-attempt" and fitter.strategy.global_rank == self.rank and state.global_step == self.step \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # torchrun restarts the job once
            raise RuntimeError(f"injected failure on rank {self.rank}, first attempt only")

    def on_evaluate(self, fitter, state, control, metrics):
        pass


class OutOfMemoryOnRank1(Classifier):
    """Rank 1 runs out of memory (the CPU allocator's error) in its third training forward."""

    forwards = 0

    def forward(self, batch):
        if self.training and int(os.environ.get("RANK", "0")) == 1:
            OutOfMemoryOnRank1.forwards += 1
            if OutOfMemoryOnRank1.forwards == 3:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return super().forward(batch)


class StopOnSave(ll.Callback):
    """Stop at the first save, on every rank (on_save runs on every rank), and say so in a file."""

    def __init__(self, out):
        self.out = out

    def on_save(self, fitter, state, control, path):
        control.should_training_stop = True
        (self.out / f"on_save-rank{fitter.strategy.global_rank}.txt").write_text(f"{state.global_step} {Path(path).name}")


class BrokenData(DictDataset):
    """Items fail to load on rank ``rank`` once ``after`` of them were served (a corrupt record)."""

    def __init__(self, rank, after, **kw):
        super().__init__(**kw)
        self.rank, self.after, self.served = rank, after, 0

    def __getitem__(self, i):
        self.served += 1
        if int(os.environ.get("RANK", "0")) == self.rank and self.served > self.after:
            raise ValueError(f"corrupt record on rank {self.rank}")
        return super().__getitem__(i)


class SignalAt(ll.Callback):
    """Send ``signum`` to this rank only, after optimizer step ``step``: SIGKILL is a real kill
    (torchrun then ends the rest), SIGTERM a preemption seen by one rank."""

    def __init__(self, rank, step, signum):
        self.rank, self.step, self.signum = rank, step, signum

    def on_step_end(self, fitter, state, control):
        if fitter.strategy.global_rank == self.rank and state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class Footprint(ll.Callback):
    """Record this rank's parameter + gradient + optimizer bytes just before the last optimizer
    step, when gradients and optimizer state both exist."""

    def __init__(self, out):
        self.out = out

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        if state.global_step + 1 == state.max_steps:
            footprint = memory_footprint(fitter.strategy, fitter.model, fitter.optimizer)
            (self.out / f"footprint-rank{fitter.strategy.global_rank}.json").write_text(json.dumps(footprint))


class WhereItRan(ll.Callback):
    """Record the device this rank trained on and the process group's backend (a GPU run checks
    it trained where it was meant to, with nccl)."""

    def __init__(self, out):
        self.out = out

    def on_fit_start(self, fitter, state, control):
        import torch.distributed as dist

        where = {"device": str(next(fitter.module.parameters()).device),
                 "backend": dist.get_backend() if dist.is_initialized() else None}
        self.out.mkdir(parents=True, exist_ok=True)  # rank 0 may not have made output_dir yet (as a
        # fit makes it: torchrun's recipe launches into a folder that does not exist)
        (self.out / f"where-rank{fitter.strategy.global_rank}.json").write_text(json.dumps(where))


class DropoutClassifier(Classifier):
    """Dropout in training: a resumed run must restore the device's random state (CUDA's on a GPU)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net.insert(2, nn.Dropout(0.25))


class IntTokenClassifier(TokenClassifier):
    """Item counts as host ints (not tensors): they differ between ranks all the same."""

    def num_items(self, batch):
        return int(batch["w"].sum())


class FailingMetrics(Classifier):
    def metrics(self, outputs, batch):
        if int(os.environ.get("RANK", "0")) == 1:
            raise RuntimeError("injected failure in metrics on rank 1")
        return {}


class Recording(DictDataset):
    """Records the indices it serves (num_workers=0), dumped per rank after the fit."""

    served: list[int] = []

    def __getitem__(self, i):
        Recording.served.append(int(i))
        return super().__getitem__(i)


class UnevenStream(torch.utils.data.IterableDataset):
    """An iterable dataset that shards itself unevenly: rank r yields 5 - 2r items per epoch."""

    shards_itself = True

    def __init__(self, dtype):
        self.data = DictDataset(n=8, dtype=dtype)

    def __iter__(self):
        rank = int(os.environ.get("RANK", "0"))
        return iter([self.data[i] for i in range(5 - 2 * rank)])


class F1Module(Classifier):
    def metrics(self, outputs, batch):
        return {"accuracy": (outputs.argmax(-1) == batch["y"]).double().mean()}

    def predictions(self, outputs, batch):
        return outputs.argmax(-1)

    def compute_metrics(self, predictions, labels):
        return {"n": float(len(predictions)), "first_label": float(labels[0])}


class Block(nn.Module):  # a default FSDP shard unit (its class name ends in "Block")
    calls = 0  # forwards in training mode (a checkpointed block runs twice per step)

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        Block.calls += self.training
        return torch.tanh(self.lin(x))


class NormBlock(Block):
    """A shard unit with running statistics (checkpointing's recompute must not update them twice)."""

    def __init__(self, width):
        super().__init__(width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        Block.calls += self.training
        return torch.tanh(self.norm(self.lin(x)))


class FrozenFirst(Classifier):
    """The first layer frozen (requires_grad False): not in the optimizer, still in the weights."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net[0].requires_grad_(False)


class OnlyModule(Classifier):
    """Every parameter under one submodule named ``module`` (the name DDP's wrapper gives its own)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.module = self.net
        del self.net

    def forward(self, batch):
        return self.module(batch["x"])


class MaybeCheckpointed(Classifier):
    """No shard unit: its own maybe_checkpoint is what checkpoints (calls counted as Block's)."""

    def forward(self, batch):
        def body(x):
            Block.calls += 1
            return self.net(x)
        return self.maybe_checkpoint(body, batch["x"])


class F1Blocks(F1Module):
    """F1Module with two shard units: under FSDP each forward all-gathers their parameters."""

    def __init__(self, width=16):
        super().__init__(width=width)
        self.net = nn.Sequential(nn.Linear(8, width), Block(width), Block(width), nn.Linear(width, 3))


class ListBlocks(Classifier):
    """Two Blocks in an nn.ModuleList: the repeated blocks compile_regions compiles one by one (and
    FSDP's default shard units)."""

    def __init__(self, width=16):
        super().__init__(width=width)
        self.net = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 3))
        self.blocks = nn.ModuleList([Block(width), Block(width)])

    def forward(self, batch):
        x = self.net[0](batch["x"])
        for block in self.blocks:
            x = block(x)
        return self.net[1](x)


class QuietBlock(Block):
    """Block without the Python side effect (the call count): torch.compile traces a checkpoint
    only over code without one (else its graph breaks there)."""

    def forward(self, x):
        return torch.tanh(self.lin(x))


class QuietBlocks(ListBlocks):
    """ListBlocks of QuietBlocks (compile_regions, with activation checkpointing or without)."""

    def __init__(self, width=16):
        super().__init__(width=width)
        self.blocks = nn.ModuleList([QuietBlock(width), QuietBlock(width)])


class F1NormBlocks(F1Module):
    """F1Blocks whose units hold BatchNorm statistics."""

    def __init__(self, width=16):
        super().__init__(width=width)
        self.net = nn.Sequential(nn.Linear(8, width), NormBlock(width), NormBlock(width), nn.Linear(width, 3))


def main(argv: list[str] | None = None) -> None:
    if os.environ.get("LIGHTLIKE_DUMP_AFTER"):  # a test's launcher: where this rank stands if it hangs
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["LIGHTLIKE_DUMP_AFTER"]), exit=False)
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", default="train")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--epochs", type=int, default=0, help="max_epochs instead of max_steps")
    p.add_argument("--stop", type=int, default=0)
    p.add_argument("--task", default="plain")
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--resume", nargs="?", const=True, default=None, help="resume=True, or --resume auto")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--max-grad-norm", type=float, default=0.0)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--signal-step", type=int, default=0)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--meta", action="store_true", help="build the module on the meta device")
    p.add_argument("--init-module", action="store_true", help="build the module in fitter.init_module()")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compile", default="", choices=["", "step", "regions"], help="compile=True (regions: compile_regions)")
    p.add_argument("--data", default="dict", choices=["dict", "recording", "uneven-stream", "user-shuffled",
                                                        "user-uneven-sampler"])
    p.add_argument("--no-overwrite", action="store_true", help="refuse an output_dir that holds a run")
    p.add_argument("--eval-on-epoch-end", action="store_true")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--rank-seed", action="store_true", help="each rank seeds its module's build with its rank")
    p.add_argument("--unreadable-on-rank1", default="", help="rank 1's checksum pass of this checkpoint fails (EIO)")
    p.add_argument("--ema", action="store_true", help="a user state, states={'ema': EMA()}, updated at each step's "
                   "end (ema-rank{r}.pt: its state after the fit)")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if args.unreadable_on_rank1 and rank == 1:  # a transient read error, or a node's stale view of the files
        from lightlike.checkpoint import manifest

        verify = manifest.verify_checkpoint

        def flaky(path, hashes=True, **kw):
            if Path(path).name == args.unreadable_on_rank1 and hashes:
                raise OSError(5, "Input/output error", str(path))
            return verify(path, hashes=hashes, **kw)

        manifest.verify_checkpoint = flaky
    out = Path(args.out)
    torch.manual_seed(rank if args.rank_seed else 0)  # --rank-seed: each rank builds other initial weights
    if args.mode == "fail-eval":  # a failure on rank 1 inside validate(), outside any fit()
        fitter = ll.Fitter(max_steps=1, eval_batch_size=args.batch, output_dir=str(out), loggers=[], log_level="warning")
        fitter.validate(FailingMetrics().double(), DictDataset(n=args.items, dtype=torch.float64))
        return
    if args.mode == "eval":
        dtype = getattr(torch, args.dtype)
        fitter = ll.Fitter(max_steps=1, eval_batch_size=args.batch, output_dir=str(out), loggers=[], log_level="warning",
                           strategy=args.strategy)
        with fitter.init_module() if args.init_module else contextlib.nullcontext():
            model = (F1Blocks if args.task == "blocks" else F1Module)(width=args.width).to(dtype)
        metrics = fitter.validate(model, DictDataset(n=args.items, dtype=dtype))
        pred = fitter.predict(model, DictDataset(n=args.items, dtype=dtype))
        if rank == 0:
            (out / "eval.json").write_text(json.dumps({"metrics": metrics, "predictions": pred.predictions.tolist(),
                                                       "labels": pred.labels.tolist()}))
        return
    if args.mode == "ddp-after-fsdp":  # a module an FSDP fit left sharded, then given to a DDP Fitter
        fitter = ll.Fitter(max_steps=1, batch_size=args.batch, output_dir=str(out / "fsdp"), loggers=[],
                           log_level="warning", strategy="fsdp")
        model = F1Blocks(width=args.width).double()
        fitter.fit(model, DictDataset(n=args.items, dtype=torch.float64))
        try:
            ll.Fitter(eval_batch_size=args.batch, output_dir=str(out / "ddp"), loggers=[], log_level="warning",
                      strategy="ddp").predict(model, DictDataset(n=args.items, dtype=torch.float64))
            message = "no error"
        except ll.ConfigError as e:
            message = str(e)
        (out / f"rank{rank}.txt").write_text(message)
        return
    module_cls = {"token": TokenClassifier, "inttoken": IntTokenClassifier, "blocks": F1Blocks, "norm-blocks": F1NormBlocks,
                  "maybe-checkpointed": MaybeCheckpointed, "frozen-first": FrozenFirst,
                  "only-module": OnlyModule, "dropout": DropoutClassifier, "list-blocks": ListBlocks,
                  "quiet-blocks": QuietBlocks}.get(args.task, Classifier)
    if args.mode == "oom":
        module_cls = OutOfMemoryOnRank1
    dtype = getattr(torch, args.dtype)
    if args.meta:
        with torch.device("meta"):
            model = module_cls(width=args.width).to(dtype)
    elif args.init_module:
        model = None  # built below, once the Fitter (and its process group) exists
    else:
        model = module_cls(width=args.width).to(dtype)
    strategy = args.strategy
    if strategy == "ddp:static-graph":
        from lightlike.strategies.ddp import DDPStrategy

        strategy = DDPStrategy(static_graph=True)
    elif strategy == "ddp:no-bucket-view":  # torch's default: the gradients beside DDP's buckets
        from lightlike.strategies.ddp import DDPStrategy

        strategy = DDPStrategy(gradient_as_bucket_view=False)
    elif strategy.startswith("hsdp:"):  # hsdp:<shard size>
        from lightlike.strategies.fsdp import FSDPStrategy

        strategy = FSDPStrategy(hybrid=True, shard_size=int(strategy.split(":")[1]))
    elif strategy == "fsdp:async":
        from lightlike.strategies.fsdp import FSDPStrategy

        strategy = FSDPStrategy(async_save=True)
    elif strategy == "fsdp:own-16-mixed":  # an instance bringing its own precision (the Fitter's 'auto')
        from lightlike.precision import MixedPrecision
        from lightlike.strategies.fsdp import FSDPStrategy

        strategy = FSDPStrategy(precision=MixedPrecision("16", init_scale=2.0**10, growth_interval=1))
    callbacks: list = []
    callbacks.append(Footprint(out))
    callbacks.append(WhereItRan(out))
    if args.stop:
        callbacks.append(StopAt(args.stop))
    if args.kill_step:
        callbacks.append(SignalAt(args.fail_rank, args.kill_step, signal.SIGKILL))
    if args.signal_step:
        callbacks.append(SignalAt(args.fail_rank, args.signal_step, signal.SIGTERM))
    if args.mode == "fail":
        callbacks.append(FailAt(args.fail_rank, args.fail_step, "train"))
    if args.mode == "fail-once":
        callbacks.append(FailAt(args.fail_rank, args.fail_step, "first-attempt"))
    if args.mode == "stop-on-save":
        callbacks.append(StopOnSave(out))
    ema = EMA() if args.ema else None
    if ema is not None:
        callbacks.append(KeepsEMA(ema))
    fitter = ll.Fitter(max_steps=None if args.epochs else args.steps, max_epochs=args.epochs or None,
                       batch_size=args.batch, grad_accum_steps=args.accum, learning_rate=1e-2,
                       lr_scheduler="constant", output_dir=str(out), loggers=["jsonl"], log_every=args.log_every,
                       save_every=args.save_every or None, max_grad_norm=args.max_grad_norm or None,
                       log_level="warning", callbacks=callbacks,
                       overwrite_output_dir=not (args.resume or args.no_overwrite),
                       strategy=strategy, precision=args.precision,
                       gradient_checkpointing=args.gradient_checkpointing,
                       eval_on_epoch_end=args.eval_on_epoch_end, auto_find_batch_size=args.mode == "oom",
                       compile=bool(args.compile), compile_regions=args.compile == "regions",
                       **({"states": {"ema": ema}} if ema is not None else {}))
    if model is None:
        context = fitter.init_module()  # sets up the process group (which may draw random numbers)
        torch.manual_seed(0)  # the same initial weights as the other runs
        with context:
            model = module_cls(width=args.width)
            if dtype != torch.float32:
                model = model.to(dtype)
    if args.data == "uneven-stream":
        train: torch.utils.data.Dataset = UnevenStream(dtype)
    elif args.data == "recording":
        train = Recording(n=args.items, dtype=dtype)
    elif args.data == "user-uneven-sampler":  # a ResumableSampler without even=True: shares differ by one
        from lightlike.data import ResumableSampler

        sampler = ResumableSampler(args.items, rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        train = torch.utils.data.DataLoader(DictDataset(n=args.items, dtype=dtype), batch_size=args.batch,
                                            sampler=sampler)
    elif args.data == "user-shuffled":  # a DataLoader of the user's with torch's RandomSampler
        train = torch.utils.data.DataLoader(DictDataset(n=args.items, dtype=dtype), batch_size=args.batch, shuffle=True)
    elif args.mode == "fail-data":  # the batch of step fail_step + 1 fails to load on fail_rank
        train = BrokenData(args.fail_rank, args.fail_step * args.batch * args.accum, n=args.items, dtype=dtype)
    else:
        train = DictDataset(n=args.items, dtype=dtype)
    val = DictDataset(n=5, dtype=dtype) if args.data == "uneven-stream" else None
    fitter.fit(model, train, val, resume=args.resume or None)
    if args.data == "recording":
        (out / f"served-{'resumed' if args.resume else 'first'}-rank{fitter.strategy.global_rank}.json").write_text(
            json.dumps(Recording.served))
    (out / f"block-calls-rank{fitter.strategy.global_rank}.txt").write_text(str(Block.calls))
    if isinstance(fitter.module, ListBlocks):  # what the module now calls as its blocks (wrapped by checkpointing?)
        (out / "block-types.txt").write_text(" ".join(type(b).__name__ for b in fitter.module.blocks))
    # the last preemption vote was waited for and dropped: no collective handle outlives the fit
    assert fitter.preemption.vote is None, "a preemption vote is still in flight after fit()"
    strategy = fitter.strategy
    rank = strategy.global_rank  # under SLURM, known once the Fitter has read the environment
    # full weights (gathered from the shards under FSDP/ZeRO: collective, so every rank asks)
    full = {k: v.detach().clone().cpu() for k, v in strategy.checkpoint_layout.module_state_dict(fitter.model).items()}
    torch.save(full, out / f"final-rank{rank}.pt")
    if ema is not None:
        torch.save(ema.state_dict(), out / f"ema-rank{rank}.pt")
    scaler = getattr(strategy.precision, "scaler", None)
    if scaler is not None:
        (out / f"scaler-rank{rank}.json").write_text(json.dumps(
            {"class": type(scaler).__name__, "scale": scaler.get_scale(), "growth_interval": scaler._growth_interval}))


def each(argv: list[str], run=None) -> None:
    """``run`` (``main``) once per run of ``OUT ARGS [--then OUT ARGS ...]``, in order, each from
    the counters a fresh process starts with (the seed is each run's own: ``main`` sets it)."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    from lightlike.checkpoint import manifest

    verify = manifest.verify_checkpoint  # --unreadable-on-rank1 replaces it for its run
    for args in runs:
        Block.calls = 0
        Recording.served = []
        OutOfMemoryOnRank1.forwards = 0
        manifest.verify_checkpoint = verify
        (run or main)(args)


if __name__ == "__main__":
    each(sys.argv[1:])

"""A short fit that can SIGKILL itself at a chosen point; used by tests/checkpoint/test_kill_matrix.py.

    python kill_target.py OUT_DIR --precision 32-true --workers 0 [--kill micro:7|eval:3|save:2:4|step:5]

``micro:N``  kill in the N-th training forward (mid-step; mid-window when N is not a window's last)
``eval:N``   kill in the N-th evaluation forward
``save:N:K`` kill in the N-th checkpoint save after it has written K files
``step:N``   kill right after optimizer step N (before its log/eval/save)
``term:N``, ``usr1:N``  send SIGTERM / SIGUSR1 after step N (preemption: save, exit 75)
``termgroup:N``  SIGTERM to the whole process group (DataLoader workers too) after step N
``termgroupstart:N``  the same, 0.5 s after step N, while the evaluation's workers start (slowly)
``termmicro:N``  SIGTERM in the N-th training forward (mid-window): saved after that step
``term2:N``  SIGTERM after step N and again in the middle of the preemption save
``termload``  SIGTERM while the resumed checkpoint is being loaded (set-up, before the loop)
``--no-requeue`` sets requeue_on_preemption=False (no ``scontrol requeue`` under SLURM).
``--manual`` trains ``ManualNet`` (manual optimization: two optimizers, two backward passes a step,
one batch a step: 24 training forwards in 12 steps).
``--step-sleep S`` makes each step take S seconds longer (a kill from outside then lands mid-run).
Without --kill it runs (or resumes) to the end and writes OUT_DIR/final.safetensors.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.checkpoint import atomic, find_latest_valid  # noqa: E402

COUNTS = {"micro": 0, "eval": 0, "save": 0}
KILL: list[str] = []


def die() -> None:
    print(f"kill fired: {':'.join(KILL)}")  # the test checks that its kill point was reached
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Net(Classifier):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, batch):
        kind = "micro" if self.training else "eval"
        COUNTS[kind] += 1
        if KILL and KILL[0] == kind and COUNTS[kind] == int(KILL[1]):
            die()
        if KILL and KILL[0] == "termmicro" and kind == "micro" and COUNTS[kind] == int(KILL[1]):
            os.kill(os.getpid(), signal.SIGTERM)  # preemption in the middle of a window
        return self.net(self.drop(batch["x"]))


class ManualNet(Net):
    """Manual optimization (``--manual``): the last layer steps on the loss (SGD with momentum),
    then the first on a second forward and backward with the last layer frozen (AdamW with a
    warmup schedule): two forwards, two backward passes and two optimizers per step."""

    def configure_optimizers(self, config):
        first = torch.optim.AdamW(self.net[0].parameters(), lr=1e-2)
        last = torch.optim.SGD(self.net[2].parameters(), lr=1e-2, momentum=0.9)
        return [(first, torch.optim.lr_scheduler.LambdaLR(first, lambda s: min(1.0, (s + 1) / 3))), last]

    def training_step(self, batch, ctx):
        first, last = ctx.optimizers
        loss = self.loss(self(batch), batch)
        ctx.backward(loss)
        ctx.step(last)
        self.net[2].requires_grad_(False)
        again = self.loss(self(batch), batch)
        ctx.backward(again)
        ctx.step(first)
        self.net[2].requires_grad_(True)
        return {"loss": loss.detach(), "loss_again": again.detach()}


class KillAfterStep(ll.Callback):
    step_sleep = 0.0  # --step-sleep: slow steps, for kills from outside at wall-clock moments

    def on_step_end(self, fitter, state, control):
        time.sleep(self.step_sleep)
        if KILL and KILL[0] == "step" and state.global_step == int(KILL[1]):
            die()
        if KILL and KILL[0] in ("term", "usr1", "term2") and state.global_step == int(KILL[1]):
            COUNTS["signalled"] = 1
            os.kill(os.getpid(), signal.SIGUSR1 if KILL[0] == "usr1" else signal.SIGTERM)
        if KILL and KILL[0] == "termgroupstart" and state.global_step == int(KILL[1]):
            # while the evaluation that follows this step starts its workers (each slowed down, below)
            subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(0.5); "
                              f"os.killpg({os.getpgid(0)}, signal.SIGTERM)"])
        if KILL and KILL[0] == "termgroup" and state.global_step == int(KILL[1]):
            # from another process, as torchrun and SLURM send it (torch's worker handler ignores
            # only a SIGTERM of the worker's parent), to every process of the group: workers too
            subprocess.run([sys.executable, "-c", f"import os, signal; os.killpg({os.getpgid(0)}, signal.SIGTERM)"],
                           check=False)


def patch_saves() -> None:
    """Count files written by checkpoint saves; die after K files of the N-th save."""
    original = atomic.CheckpointWriter.path_for
    enter = atomic.CheckpointWriter.__enter__
    files = {"n": 0}

    def counting_enter(self):
        COUNTS["save"] += 1
        files["n"] = 0
        return enter(self)

    def counting_path_for(self, rel):
        if KILL and KILL[0] == "term2" and COUNTS.get("signalled") and files["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal in the middle of the save
        if KILL and KILL[0] == "save" and COUNTS["save"] == int(KILL[1]) and files["n"] == int(KILL[2]):
            die()
        files["n"] += 1
        return original(self, rel)

    atomic.CheckpointWriter.__enter__ = counting_enter
    atomic.CheckpointWriter.path_for = counting_path_for


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--kill", default="")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--async-save", action="store_true", help="commit checkpoints in a background thread")
    p.add_argument("--start-method", help="multiprocessing start method of the DataLoader workers")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step end waits (no effect on numbers)")
    p.add_argument("--no-requeue", action="store_true", help="requeue_on_preemption=False")
    p.add_argument("--manual", action="store_true", help="a module with training_step (manual optimization)")
    args = p.parse_args()
    KillAfterStep.step_sleep = args.step_sleep
    if args.start_method:
        import multiprocessing

        multiprocessing.set_start_method(args.start_method)
    KILL.extend(args.kill.split(":") if args.kill else [])
    if KILL and KILL[0] == "termgroupstart":  # a worker takes 2 s to start (a loaded machine, a slow import)
        main_pid, set_num_threads = os.getpid(), torch.set_num_threads

        def slow_in_a_worker(n):
            if os.getpid() != main_pid:
                time.sleep(2.0)
            set_num_threads(n)

        torch.set_num_threads = slow_in_a_worker
    patch_saves()
    if KILL and KILL[0] == "termload":
        from lightlike.checkpoint.checkpointer import Checkpointer

        load = Checkpointer.load

        def signalled_load(self, *a, **kw):
            os.kill(os.getpid(), signal.SIGTERM)
            return load(self, *a, **kw)

        Checkpointer.load = signalled_load
    torch.manual_seed(0)
    model = ManualNet() if args.manual else Net()
    resume = find_latest_valid(args.out) is not None
    optimizer = {} if args.manual else {"grad_accum_steps": 2, "learning_rate": 1e-2, "warmup_steps": 2}
    fitter = ll.Fitter(max_steps=args.steps, batch_size=4, **optimizer,
                       save_every=2, eval_every=3, log_every=1, loggers=["jsonl", "csv"], output_dir=args.out,
                       precision=args.precision, num_workers=args.workers, seed=3,
                       overwrite_output_dir=not resume, model_summary=False, log_level="warning",
                       callbacks=[KillAfterStep()], async_save=args.async_save,
                       requeue_on_preemption=not args.no_requeue)
    # 26 items in batches of 4: 7 batches per epoch, the last one short; 4 steps per epoch, the
    # last window holding a single batch
    fitter.fit(model, DictDataset(n=26), DictDataset(n=6, seed=9), resume=resume)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.safetensors"))


if __name__ == "__main__":
    main()

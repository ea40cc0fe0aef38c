"""Small modules and datasets shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import lightlike as ll


class DictDataset(Dataset):
    """Items are dicts of tensors; ``x`` features, ``y`` class labels, ``w`` item weights."""

    def __init__(self, n: int = 64, features: int = 8, classes: int = 3, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g, dtype=dtype)
        self.y = torch.randint(0, classes, (n,), generator=g)
        # how many "tokens" each item holds, for uneven item counts (1..4)
        self.w = torch.randint(1, 5, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "w": self.w[i]}


class Classifier(ll.TaskModule):
    def __init__(self, features: int = 8, classes: int = 3, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, classes))

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])

    def metrics(self, outputs, batch):
        return {"accuracy": (outputs.argmax(-1) == batch["y"]).float().mean()}


class TokenClassifier(Classifier):
    """Each item counts as ``w`` items (think: tokens). The loss is the mean over those items,
    and ``num_items`` reports their number as a device tensor."""

    def loss(self, outputs, batch):
        per_item = nn.functional.cross_entropy(outputs, batch["y"], reduction="none")
        w = batch["w"].to(per_item.dtype)
        return (per_item * w).sum() / w.sum()

    def num_items(self, batch):
        return batch["w"].sum()


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in module.parameters()])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc): torchrun starts each rank in a session of its own."""
    import os
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def run_killing_group(cmd, *, timeout, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``, but on a timeout the command
    and every process below it are SIGKILLed: a hung torchrun's ranks (sessions of their own, which
    ignore SIGTERM while a preemption handler is set) do not stay behind loading the machine, nor
    hold the output pipes open."""
    import os
    import signal
    import subprocess
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [p.pid, *_descendants(p.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class StopAt(ll.Callback):
    """Raises KeyboardInterrupt as optimizer step ``step`` ends: like a kill right after that
    step's checkpoint."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            raise KeyboardInterrupt


class EMA:
    """A user state (``Fitter(states={"ema": ema})``): an exponential moving average of a
    module's full weights as one float64 tensor, and the int count of its updates (its decay
    depends on it)."""

    def __init__(self):
        self.shadow: torch.Tensor | None = None
        self.updates = 0

    def update(self, weights: torch.Tensor) -> None:
        decay = min(0.9, (1 + self.updates) / (10 + self.updates))
        self.shadow = weights.clone() if self.shadow is None else self.shadow * decay + weights * (1 - decay)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow, self.updates = state["shadow"], state["updates"]


class KeepsEMA(ll.Callback):
    """Updates an ``EMA`` with the full weights at each step's end (gathered from the shards under
    FSDP and ZeRO: a collective, which every rank runs)."""

    def __init__(self, ema: EMA):
        self.ema = ema

    def on_step_end(self, fitter, state, control):
        full = fitter.strategy.checkpoint_layout.module_state_dict(fitter.model)
        self.ema.update(torch.cat([v.detach().reshape(-1).to("cpu", torch.float64) for v in full.values()]))


class Dropout(Classifier):
    """The Classifier with dropout on its input: training draws from the random stream."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, batch):
        return self.net(self.drop(batch["x"]))


def stacked_batches(n, bs):
    """The first ``n`` items of ``DictDataset(n=n)`` in batches of ``bs``, stacked by hand."""
    data = DictDataset(n=n)
    for s in range(0, n, bs):
        yield {k: torch.stack([data[i][k] for i in range(s, s + bs)]) for k in ("x", "y", "w")}


class MixtureDataset(Dataset):
    """Real points ``x`` from a mixture of 2-D Gaussians and noise ``z`` for a generator."""

    def __init__(self, n: int = 64, noise: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        centres = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0]], dtype=dtype)
        self.x = centres[torch.randint(0, 3, (n,), generator=g)] + 0.2 * torch.randn(n, 2, generator=g, dtype=dtype)
        self.z = torch.randn(n, noise, generator=g, dtype=dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "z": self.z[i]}


def gan_losses(D, fake, real):
    """The discriminator's loss on ``real`` and detached ``fake`` points, and the generator's."""
    bce = nn.functional.binary_cross_entropy_with_logits
    real_logits, fake_logits = D(real), D(fake.detach())
    loss_d = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
    return loss_d, lambda: bce(D(fake), torch.ones_like(fake_logits))


class GAN(ll.TaskModule):
    """The issue's manual optimization example: D steps, then G steps with D frozen."""

    def __init__(self, noise: int = 4, width: int = 16, lr: float = 1e-2):
        super().__init__()
        self.lr = lr
        self.G = nn.Sequential(nn.Linear(noise, width), nn.Tanh(), nn.Linear(width, 2))
        self.D = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, batch):
        return self.G(batch["z"])

    def configure_optimizers(self, config):
        return [torch.optim.Adam(self.G.parameters(), self.lr), torch.optim.Adam(self.D.parameters(), self.lr)]

    def training_step(self, batch, ctx):
        opt_g, opt_d = ctx.optimizers
        fake = self(batch)
        loss_d, generator_loss = gan_losses(self.D, fake, batch["x"])
        ctx.backward(loss_d)
        ctx.step(opt_d)
        self.D.requires_grad_(False)
        loss_g = generator_loss()
        ctx.backward(loss_g)
        ctx.step(opt_g)
        self.D.requires_grad_(True)
        return {"loss": loss_g.detach(), "loss_d": loss_d.detach()}


def hand_written_gan(model: GAN, data: Dataset, *, steps: int, batch_size: int, autocast: torch.dtype | None = None,
                     scaler: torch.amp.GradScaler | None = None, dtype: torch.dtype | None = None,
                     schedulers: bool = False) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The same GAN steps written by hand in plain PyTorch, batches in dataset order: under CPU
    autocast in ``autocast``, with torch's multi-optimizer AMP recipe when given a ``scaler``
    (``scaler.step`` per optimizer, one ``scaler.update`` per iteration), in true ``dtype``."""
    import contextlib

    from torch.utils.data import DataLoader

    if dtype is not None:
        model.to(dtype)
    pairs = model.configure_optimizers(None)
    pairs = [(p["optimizer"], p["lr_scheduler"]) if isinstance(p, dict) else p for p in pairs]
    opts = [p[0] if isinstance(p, tuple) else p for p in pairs]
    scheds = [p[1] if isinstance(p, tuple) else None for p in pairs]
    opt_g, opt_d = opts

    def backward(loss):
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def step(i):
        if scaler is not None:
            scaler.step(opts[i])
        else:
            opts[i].step()
        opts[i].zero_grad(set_to_none=True)
        if scheds[i] is not None:
            scheds[i].step()

    done = 0
    while done < steps:
        for batch in DataLoader(data, batch_size=batch_size):
            if dtype is not None:
                batch = {k: v.to(dtype) for k, v in batch.items()}
            with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
                fake = model.G(batch["z"])
                loss_d, generator_loss = gan_losses(model.D, fake, batch["x"])
                backward(loss_d)
                step(1)
                model.D.requires_grad_(False)
                backward(generator_loss())
                step(0)
                model.D.requires_grad_(True)
            if scaler is not None:
                scaler.update()
            done += 1
            if done == steps:
                break
    return opts, scheds


class InfiniteGradient(Classifier):
    """A finite loss whose gradient is +inf at every step (d sqrt(z)/dz at z = 0)."""

    def __init__(self):
        super().__init__()
        self.z = nn.Parameter(torch.zeros(1))

    def loss(self, outputs, batch):
        return super().loss(outputs, batch) + self.z.sqrt().sum()


class HostReads(ll.Callback):
    """Counts reads of a tensor to the host (``.item()``, ``float()``, ``bool()``, ...: each a
    device sync on a GPU) from the start of step ``first`` through the boundary of step ``last``
    (``watching``, which a test may also set itself). ``install(monkeypatch)`` wraps the read
    methods of ``torch.Tensor``; ``reads`` lists the names of the reads seen."""

    NAMES = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, first: int = 2, last: int = 9):
        self.first, self.last = first, last
        self.reads: list[str] = []
        self.watching = False

    def install(self, monkeypatch) -> None:
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.watching:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)

        return read

    def on_step_start(self, fitter, state, control):
        self.watching = self.first <= state.global_step + 1 <= self.last

    def on_step_end(self, fitter, state, control):
        self.watching = self.first <= state.global_step < self.last  # through the last step's boundary work

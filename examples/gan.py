"""Manual optimization: a small GAN on a ring of 2-D Gaussians, on the CPU in well under a minute.

The module defines ``training_step(batch, ctx)``, which switches it to manual optimization: it
steps the discriminator, then the generator with the discriminator frozen, with its own two
optimizers (docs/manual_optimization.md). Both losses are logged (``train/loss`` is the
generator's, ``train/loss_d`` the discriminator's). At the end a picture of generated against
real points goes to TensorBoard (``output_dir/logs``, when tensorboard is installed) and to
``output_dir/samples.png`` (when matplotlib is installed: ``pip install lightlike[plots]``).

    python examples/gan.py [--steps 800] [--output-dir runs/gan]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import lightlike as ll

MODES = 8  # Gaussians on a ring of radius 2


class Ring(Dataset):
    """``n`` items ``{"x": a real point, "z": generator noise}``."""

    def __init__(self, n: int, noise: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        angle = torch.randint(0, MODES, (n,), generator=g) * (2 * math.pi / MODES)
        centres = 2.0 * torch.stack([angle.cos(), angle.sin()], dim=1)
        self.x = centres + 0.05 * torch.randn(n, 2, generator=g)
        self.z = torch.randn(n, noise, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "z": self.z[i]}


def mlp(inputs: int, outputs: int, width: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
                         nn.Linear(width, outputs))


class GAN(ll.TaskModule):
    def __init__(self, noise: int = 8, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.G, self.D = mlp(noise, 2), mlp(2, 1)

    def forward(self, batch):  # generated points (evaluation and predict call it too)
        return self.G(batch["z"])

    def configure_optimizers(self, config):  # in the order ctx.optimizers gives them
        lr = self.hparams["lr"]
        return [torch.optim.Adam(self.G.parameters(), lr, betas=(0.5, 0.999)),
                torch.optim.Adam(self.D.parameters(), lr, betas=(0.5, 0.999))]

    def training_step(self, batch, ctx):  # defining it switches to manual optimization
        opt_g, opt_d = ctx.optimizers
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self(batch)
        real_logits, fake_logits = self.D(batch["x"]), self.D(fake.detach())
        loss_d = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
        ctx.backward(loss_d)
        ctx.step(opt_d)
        self.D.requires_grad_(False)  # the generator's backward leaves D's gradients alone
        fooled = self.D(fake)
        loss_g = bce(fooled, torch.ones_like(fooled))
        ctx.backward(loss_g)
        ctx.step(opt_g)
        self.D.requires_grad_(True)
        return {"loss": loss_g.detach(), "loss_d": loss_d.detach()}

    def metrics(self, outputs, batch):  # no loss() is needed: evaluation reports these
        angles = torch.arange(MODES, device=outputs.device) * (2 * math.pi / MODES)
        centres = 2.0 * torch.stack([angles.cos(), angles.sin()], dim=1)
        distance = torch.cdist(outputs, centres).min(dim=1).values
        return {"distance_to_mode": distance.mean(), "near_a_mode": (distance < 0.25).float().mean()}


def picture(real: torch.Tensor, fake: torch.Tensor, size: int = 128) -> torch.Tensor:
    """An RGB image (3, size, size) of the square [-3, 3]^2: real points red, generated green."""
    image = torch.zeros(3, size, size)
    for channel, points in ((0, real), (1, fake)):
        pixels = ((points.clamp(-3, 2.999) + 3) / 6 * size).long()
        image[channel, size - 1 - pixels[:, 1], pixels[:, 0]] = 1.0
    return image


def save_pictures(real: torch.Tensor, fake: torch.Tensor, output_dir: Path, step: int) -> None:
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(output_dir / "logs")) as writer:
            writer.add_image("samples/real_red_generated_green", picture(real, fake), step)
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(real[:, 0], real[:, 1], s=4, label="real")
        ax.scatter(fake[:, 0], fake[:, 1], s=4, label="generated")
        ax.set_aspect("equal")
        ax.legend()
        fig.savefig(output_dir / "samples.png", dpi=100)
        plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--output-dir", default="runs/gan")
    args = p.parse_args()
    output_dir = Path(args.output_dir)
    fitter = ll.Fitter(strategy="single", accelerator="cpu", max_steps=args.steps, batch_size=128,
                       eval_every=max(1, args.steps // 3), log_every=max(1, args.steps // 10), save_strategy="no",
                       output_dir=str(output_dir), overwrite_output_dir=True, seed=0, progress_bar=False)
    module = GAN()
    val = Ring(1024, seed=1)
    result = fitter.fit(module, Ring(8192), val)
    fake = fitter.predict(module, val).predictions
    save_pictures(val.x, fake, output_dir, result.global_step)
    print(f"step {result.global_step}: distance_to_mode {result.metrics['val/distance_to_mode']:.4f}, "
          f"near_a_mode {result.metrics['val/near_a_mode']:.3f}")


if __name__ == "__main__":
    main()

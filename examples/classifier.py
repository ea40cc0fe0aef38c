"""The README's one-screen program, runnable: a small classifier on synthetic data.

The labels come from a fixed random linear "teacher" (``y = argmax(x @ W)``), so there is
something to learn and the validation accuracy climbs well above chance (10%).

    python examples/classifier.py
"""

import torch
from torch import nn
from torch.utils.data import Dataset

import lightlike as ll


class TeacherData(Dataset):
    """``n`` items ``{"x": (in_features,) float, "y": class}`` labelled by a linear teacher."""

    def __init__(self, n: int, in_features: int = 64, classes: int = 10, seed: int = 0, teacher_seed: int = 1234):
        teacher = torch.randn(in_features, classes, generator=torch.Generator().manual_seed(teacher_seed))
        self.x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(seed))
        self.y = (self.x @ teacher).argmax(-1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


train_dataset = TeacherData(8192, seed=0)
val_dataset = TeacherData(2048, seed=1)  # same teacher, different inputs


class Classifier(ll.TaskModule):
    def __init__(self, in_features=64, classes=10, width=128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, batch):                 # the Fitter calls module(batch)
        return self.net(batch["x"])

    def loss(self, outputs, batch):           # mean over this batch's items
        return nn.functional.cross_entropy(outputs, batch["y"])

    def metrics(self, outputs, batch):        # per-batch means; the Fitter reduces them exactly
        return {"accuracy": (outputs.argmax(-1) == batch["y"]).float().mean()}


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    fitter = ll.Fitter(strategy="single", precision="bf16-mixed", max_steps=300, batch_size=32,
                       grad_accum_steps=2, learning_rate=3e-3, eval_every=100, save_every=100,
                       output_dir="runs/classifier", seed=0,
                       overwrite_output_dir=True)  # so that running it again replaces the last run
    result = fitter.fit(Classifier(), train_dataset, val_dataset)
    print(result.global_step, result.training_loss, result.metrics["val/accuracy"])

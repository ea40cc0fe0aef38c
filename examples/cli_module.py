"""A TaskModule the ``lightlike`` command line trains as it is: it brings its own data.

The labels come from a fixed random linear "teacher" (``y = argmax(x @ W)``), so the validation
accuracy climbs well above chance. The constructor's arguments are command-line flags
(``--model.width 64``) and keys of a config file's ``[model]`` table::

    lightlike fit examples/cli_module.py:Classifier --max_steps 200 --eval_every 50 --save_every 100 \\
        --output_dir runs/cli --model.width 64
    lightlike validate examples/cli_module.py:Classifier --checkpoint runs/cli
    lightlike fit examples/cli_module.py:Classifier --help     # every flag, with its help text

``teacher_data`` shows the other way to bring data: ``--data examples/cli_module.py:teacher_data``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

import lightlike as ll


class TeacherData(Dataset):
    """``n`` items ``{"x": (in_features,) float, "y": class}`` labelled by a linear teacher."""

    def __init__(self, n: int, in_features: int = 16, classes: int = 4, seed: int = 0, teacher_seed: int = 1234):
        teacher = torch.randn(in_features, classes, generator=torch.Generator().manual_seed(teacher_seed))
        self.x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(seed))
        self.y = (self.x @ teacher).argmax(-1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Classifier(ll.TaskModule):
    """A two-layer classifier.

    Args:
        in_features: input features per item.
        classes: number of classes.
        width: hidden units.
        dropout: dropout probability after the hidden layer.
        train_items: size of the synthetic training set (train_data).
        val_items: size of the synthetic validation and test sets (val_data, test_data).
    """

    def __init__(self, in_features: int = 16, classes: int = 4, width: int = 32, dropout: float = 0.0,
                 train_items: int = 1024, val_items: int = 256):
        super().__init__()
        self.save_hyperparameters()  # -> hparams.json beside the weights in every checkpoint
        self.net = nn.Sequential(nn.Linear(in_features, width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(width, classes))

    # -- the data the command line uses (unless --data names another source) ------------------
    def train_data(self) -> Dataset:
        return TeacherData(self.hparams["train_items"], self.hparams["in_features"], self.hparams["classes"], seed=0)

    def val_data(self) -> Dataset:
        return TeacherData(self.hparams["val_items"], self.hparams["in_features"], self.hparams["classes"], seed=1)

    def test_data(self) -> Dataset:
        return TeacherData(self.hparams["val_items"], self.hparams["in_features"], self.hparams["classes"], seed=2)

    # -- the task --------------------------------------------------------------------------------
    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])

    def metrics(self, outputs, batch):
        return {"accuracy": (outputs.argmax(-1) == batch["y"]).float().mean()}

    def predictions(self, outputs, batch):
        return outputs.argmax(-1)  # predict writes the predicted classes


def teacher_data(config: ll.FitConfig, module: Classifier) -> tuple[Dataset, Dataset]:
    """A ``--data`` factory: returns (train, val). It may take ``config`` and/or ``module``."""
    h = module.hparams
    return (TeacherData(4 * config.batch_size * config.grad_accum_steps, h["in_features"], h["classes"], seed=3),
            TeacherData(64, h["in_features"], h["classes"], seed=4))


if __name__ == "__main__":
    import sys

    from lightlike.cli import main

    # `python examples/cli_module.py fit --max_steps 100` = `lightlike fit examples/cli_module.py:Classifier ...`
    argv = sys.argv[1:] or ["fit", "--max_steps", "100", "--output_dir", "runs/cli", "--overwrite_output_dir"]
    sys.exit(main([argv[0], f"{__file__}:Classifier", *argv[1:]]))

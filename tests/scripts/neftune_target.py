"""A NEFTune fit under DDP (torchrun, gloo), checked from inside: ``neftune_target.py OUT``.

Hooks registered after the fit's own (at ``on_fit_start``) see each training forward's input
embeddings as the DDP-wrapped module produced them, with the random state the noise was drawn
from, and compare them with the paper's noise computed by hand (each item's real length from
its ``attention_mask``). Each rank writes ``rank<r>.json``: the forwards checked, whether each
was exact, whether any hook was left on the module after the fit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import lightlike as ll

VOCAB, DIM, LENGTH, ALPHA = 20, 8, 6, 5.0


class BagOfEmbeddings(ll.TaskModule):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, 3)

    def input_embeddings(self) -> nn.Module:
        return self.emb

    def forward(self, batch):
        h = self.emb(batch["input_ids"])
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])


def data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g) * mask
    y = torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "y": y[i]} for i in range(n)]


class Checker(ll.Callback):
    def __init__(self):
        self.checks: list[bool] = []
        self.seen: dict = {}

    def on_fit_start(self, fitter, state, control):
        module = fitter.module
        self.before_hooks = fitter.neftune is not None
        module.register_forward_pre_hook(lambda m, args: self.seen.update(batch=args[0]))
        module.emb.register_forward_pre_hook(lambda m, args: self.seen.update(rng=torch.get_rng_state()))
        module.emb.register_forward_hook(self.check)

    def check(self, emb, args, noisy):
        if not emb.training:
            return
        batch = self.seen["batch"]
        clean = nn.functional.embedding(batch["input_ids"], emb.weight).detach()
        g = torch.Generator()
        g.set_state(self.seen["rng"])
        a = ALPHA / torch.sqrt(batch["attention_mask"].sum(1).to(torch.float32) * DIM)
        expected = clean + torch.empty(clean.shape).uniform_(-1, 1, generator=g) * a.view(-1, 1, 1)
        self.checks.append(bool(torch.equal(noisy.detach(), expected)))


def hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    module = BagOfEmbeddings()
    checker = Checker()
    fitter = ll.Fitter(strategy="ddp", accelerator="cpu", max_steps=4, batch_size=4, neftune_noise_alpha=ALPHA,
                       output_dir=str(out / "run"), loggers=[], model_summary=False, callbacks=[checker])
    before = hooks(module)
    fitter.fit(module, data())
    rank = fitter.strategy.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps({
        "checks": checker.checks, "neftune_on_during_fit": checker.before_hooks,
        "hooks_left": hooks(module) - before - 3,  # less the checker's 3
        "weights": [float(p.detach().sum()) for p in module.parameters()]}))


if __name__ == "__main__":
    main()

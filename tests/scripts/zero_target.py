"""``ddp_target.py`` with three additions for the DeepSpeed tests (same launch, same outputs):

    torchrun --nproc_per_node 2 zero_target.py OUT [ddp_target options]
        [--ds-config FILE]      a DeepSpeed JSON merged into the named deepspeed_* preset
        [--schedule NAME] [--warmup N] [--weight-decay W]   Fitter settings ddp_target fixes
        [--optimizer NAME]      the built-in optimizer (default adamw)
        [--roundtrip]           after fit: set other weights through load_module_state_dict, read
                                them back and run a forward pass with them, then put the trained
                                weights back (roundtrip-rank{r}.json)
        (every run also writes footprint-step-rank{r}.json: the largest memory_footprint seen
        just before an optimizer step, when gradients are live under every strategy)

It wraps ``ddp_target.main`` by swapping in a ``Fitter`` subclass, so the training code under
test is ddp_target's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_target  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.utils.memory import memory_footprint  # noqa: E402

extra = argparse.ArgumentParser(add_help=False)
extra.add_argument("--ds-config")
extra.add_argument("--schedule")
extra.add_argument("--warmup", type=int, default=0)
extra.add_argument("--weight-decay", type=float, default=0.0)
extra.add_argument("--roundtrip", action="store_true")
extra.add_argument("--optimizer", default="adamw")
EXTRA, REST = extra.parse_known_args(sys.argv[1:])


class FootprintProbe(ll.Callback):
    """The largest params+grads+optimizer footprint seen just before an optimizer step."""

    def __init__(self):
        self.best: dict[str, int] = {}

    def on_before_optimizer_step(self, fitter, state, control, optimizer):
        fp = memory_footprint(fitter.strategy, fitter.model, optimizer)
        if sum(fp.values()) > sum(self.best.values()):
            self.best = fp

    def on_fit_end(self, fitter, state, control):
        out = Path(fitter.config.output_dir)
        (out / f"footprint-step-rank{fitter.strategy.global_rank}.json").write_text(json.dumps(self.best))


class Roundtrip(ll.Callback):
    """load_module_state_dict then module_state_dict (the fp32 master weights under ZeRO) and a
    forward pass (the parameters the module computes with), then the trained weights back."""

    def on_fit_end(self, fitter, state, control):
        strategy, model, module = fitter.strategy, fitter.model, fitter.module
        trained = strategy.checkpoint_layout.module_state_dict(model)
        other = {k: v * 0.5 + 0.125 for k, v in trained.items()}
        strategy.checkpoint_layout.load_module_state_dict(model, other)
        back = strategy.checkpoint_layout.module_state_dict(model)
        batch = {"x": torch.randn(5, 8, generator=torch.Generator().manual_seed(1))}
        plain = type(module)(**module.hparams)
        plain.load_state_dict(other)
        plain = strategy.precision.convert_module(plain)  # the same parameter dtype (bf16-true: bf16)
        batch = strategy.batch_to_device(batch)
        model.eval()
        with torch.no_grad():
            got = model(batch).float()
        model.train()
        strategy.checkpoint_layout.load_module_state_dict(model, trained)
        restored = strategy.checkpoint_layout.module_state_dict(model)
        result = {"read_back_equal": all(torch.equal(back[k], other[k]) for k in other),
                  "forward_max_diff": float((got - plain(batch).float()).abs().max()),
                  "restored_equal": all(torch.equal(restored[k], trained[k]) for k in trained)}
        out = Path(fitter.config.output_dir) / f"roundtrip-rank{strategy.global_rank}.json"
        out.write_text(json.dumps(result))


class Fitter(ll.Fitter):
    def __init__(self, config=None, *, callbacks=None, **kwargs):
        if EXTRA.schedule:
            kwargs["lr_scheduler"] = EXTRA.schedule
        kwargs["warmup_steps"] = EXTRA.warmup
        kwargs["weight_decay"] = EXTRA.weight_decay
        kwargs["optimizer"] = EXTRA.optimizer
        if EXTRA.ds_config:
            from lightlike.strategies.deepspeed import DeepSpeedStrategy

            kwargs["strategy"] = DeepSpeedStrategy.from_preset(kwargs["strategy"], config=EXTRA.ds_config)
        probes = [FootprintProbe(), *([Roundtrip()] if EXTRA.roundtrip else [])]
        super().__init__(config, callbacks=[*(callbacks or []), *probes], **kwargs)


def main(argv: list[str]) -> None:
    """One run: this script's options read from ``argv``, ddp_target's run with the rest."""
    global EXTRA
    EXTRA, rest = extra.parse_known_args(argv)
    ddp_target.main(rest)


if __name__ == "__main__":
    ll.Fitter = Fitter  # ddp_target builds ll.Fitter(...) at run time
    ddp_target.each(sys.argv[1:], run=main)  # [--then OUT ...]: several runs, as ddp_target's

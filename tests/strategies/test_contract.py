"""The Strategy contract's size (issue 40: 28 public names or fewer; Fabric's Strategy has 31)
and the checkpoint layout each strategy holds (the manifest's ``state_format`` values)."""
from __future__ import annotations

from lightlike.strategies.base import Strategy
from lightlike.strategies.layouts import CheckpointLayout, DCPLayout, DeepSpeedLayout, FullLayout
from lightlike.strategies.single import SingleDeviceStrategy


def public_names() -> set[str]:
    """The base class's public members and the attributes its ``__init__`` sets (a subclass's own
    attributes left out)."""
    class Bare(Strategy):  # the base's __init__ alone
        def setup_environment(self): ...
        def setup_module(self, module, manual=False): return module
        def no_sync(self, module, enabled): ...

    return {n for n in dir(Strategy) if not n.startswith("_")} | {n for n in vars(Bare()) if not n.startswith("_")}


def test_the_base_class_has_at_most_28_public_names():
    names = public_names()
    assert len(names) <= 28, sorted(names)
    gone = {"checkpoint_format", "resumes_from", "save_checkpoint_state", "load_checkpoint_state", "module_state_dict",
            "load_module_state_dict", "autocast", "setup_manual_module", "accelerator"}
    assert not names & gone, sorted(names & gone)
    assert "checkpoint_layout" in names


def test_each_strategy_holds_its_layout():
    from lightlike.strategies.ddp import DDPStrategy
    from lightlike.strategies.deepspeed import DeepSpeedStrategy
    from lightlike.strategies.fsdp import FSDPStrategy

    cases = [(SingleDeviceStrategy("cpu"), FullLayout, "full", ("full", "dcp")),
             (DDPStrategy("cpu"), FullLayout, "full", ("full", "dcp")),
             (FSDPStrategy("cpu"), DCPLayout, "dcp", ("dcp",)),
             (DeepSpeedStrategy("cpu", stage=2), DeepSpeedLayout, "deepspeed", ("deepspeed",))]
    for strategy, kind, fmt, resumes in cases:
        layout = strategy.checkpoint_layout
        assert type(layout) is kind and isinstance(layout, CheckpointLayout), (strategy, layout)
        assert layout.strategy is strategy
        assert (layout.format, layout.resumes_from) == (fmt, resumes), strategy

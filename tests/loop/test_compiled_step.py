"""compile=True: forward and loss compiled as one function (evaluation: forward, loss and
metrics), the compile_* options, regional compilation, per-block activation checkpointing on
one device (eager and compiled). One process, CPU (torch.compile's inductor and a C compiler): small modules, few
steps, float64 so that compiled and eager weights agree to 1e-10.

Where code runs is told by ``assume_constant_result`` counters: torch.compile calls such a
function while it traces and bakes its result into the graph, so under compile it counts
traces; eagerly it counts every call. (A plain list.append in traced code would not tell:
torch replays such side effects at every call of the compiled code.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params
from torch import nn

import lightlike as ll
from lightlike.strategies import SingleDeviceStrategy

pytestmark = pytest.mark.slow  # each compiled fit spends seconds in inductor and the C compiler


def counter() -> tuple[list[int], object]:
    """``(calls, fn)``: ``fn()`` appends to ``calls`` where it runs (see the module's docstring)."""
    calls: list[int] = []
    return calls, torch.compiler.assume_constant_result(lambda: calls.append(1) or 0)


LOSS_CALLS, loss_ran = counter()
BLOCK_CALLS, block_ran = counter()
FORWARD_CALLS: list[int] = []  # appended eagerly (never inside a compiled function)


@pytest.fixture(autouse=True)
def fresh_counts():
    torch._dynamo.reset()  # nothing compiled by an earlier test in this process is reused
    for calls in (LOSS_CALLS, BLOCK_CALLS, FORWARD_CALLS):
        calls.clear()


class Counted(Classifier):
    def loss(self, outputs, batch):
        loss_ran()
        return super().loss(outputs, batch)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        block_ran()
        return torch.tanh(self.lin(x))


class Stack(Counted):
    """Three blocks in an nn.ModuleList (the repeated blocks), between two layers of its own."""

    def __init__(self, width=16):
        super().__init__(width=width)
        self.net = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 3))
        self.blocks = nn.ModuleList([Block(width) for _ in range(3)])

    def forward(self, batch):
        FORWARD_CALLS.append(1)
        x = self.net[0](batch["x"])
        for block in self.blocks:
            x = block(x)
        return self.net[1](x)


def fit(tmp_path, module, name, val=None, n=32, **kw):
    """4 steps of 2 micro-batches of 4 items (32 items: one epoch, every batch full), float64."""
    torch.manual_seed(0)
    model = module().double()
    settings = dict(max_steps=4, batch_size=4, grad_accum_steps=2, learning_rate=1e-2, output_dir=str(tmp_path / name),
                    loggers=[], save_strategy="no", model_summary=False)
    fitter = ll.Fitter(**{**settings, **kw})
    result = fitter.fit(model, DictDataset(n=n, dtype=torch.float64), val)
    return fitter, model, result


def test_the_loss_runs_inside_the_compiled_step_and_trains_the_eager_weights(tmp_path, caplog):
    """compile=True compiled the module's forward only: the loss ran eagerly after it (an fp32
    upcast of big logits and a cross-entropy, unfused, in memory of its own). Now forward and
    loss are one compiled function, and evaluation's forward, loss and metrics another: the
    loss runs while each is traced (twice) instead of at each of the 8 micro-batches and 4
    evaluation batches, the weights are the eager ones, the module is not wrapped, and the
    first calls' time is reported."""
    val = DictDataset(n=8, seed=1, dtype=torch.float64)
    eager_fitter, eager, eager_result = fit(tmp_path, Counted, "eager", val, eval_every=2)
    assert len(LOSS_CALLS) == 8 + 4 and eager_result.compile_seconds is None
    LOSS_CALLS.clear()
    with caplog.at_level("INFO", logger="lightlike"):
        fitter, compiled, result = fit(tmp_path, Counted, "compiled", val, eval_every=2, compile=True)
    assert len(LOSS_CALLS) == 2
    torch.testing.assert_close(flat_params(compiled), flat_params(eager), rtol=1e-10, atol=1e-10)
    assert result.metrics == pytest.approx(eager_result.metrics, rel=1e-10)
    assert fitter.model is compiled  # no wrapper: weight names and state_dict are the module's own
    assert result.compile_seconds > 0
    assert "compile: the training step compiled and ran once in" in caplog.text
    assert "compile: the evaluation step compiled and ran once in" in caplog.text


class BreaksInLoss(Counted):
    """A graph break in the loss (a function torch.compile must not trace)."""

    def loss(self, outputs, batch):
        return _halved(super().loss(outputs, batch) * 2)


@torch.compiler.disable
def _halved(x):
    return x / 2


def test_a_graph_break_in_user_code_trains_and_fullgraph_makes_it_an_error(tmp_path):
    _, eager, _ = fit(tmp_path, BreaksInLoss, "eager")
    _, compiled, _ = fit(tmp_path, BreaksInLoss, "compiled", compile=True)
    torch.testing.assert_close(flat_params(compiled), flat_params(eager), rtol=1e-10, atol=1e-10)
    assert 8 < len(LOSS_CALLS) < 8 + 8  # eagerly at each micro-batch, then only traced (up to the break)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        fit(tmp_path, BreaksInLoss, "fullgraph", compile=True, compile_fullgraph=True)


@pytest.mark.parametrize("dynamic,traces", [(True, 1), (False, 2)])
def test_compile_dynamic_reaches_torch_compile(tmp_path, dynamic, traces):
    """Batches of 4, 4 and 2 items (10 items): dynamic=True traces once for every size,
    dynamic=False once per size."""
    fit(tmp_path, Counted, "run", n=10, grad_accum_steps=1, max_steps=3, compile=True, compile_dynamic=dynamic)
    assert len(LOSS_CALLS) == traces


def test_compile_mode_reaches_inductor(tmp_path):
    """mode='reduce-overhead' asks inductor for CUDA graphs, which it skips on the CPU and counts
    as skipped; the default mode asks for none."""
    from torch._dynamo.utils import counters

    before = counters["inductor"]["cudagraph_skips"]
    fit(tmp_path, Counted, "default", compile=True)
    assert counters["inductor"]["cudagraph_skips"] == before
    fit(tmp_path, Counted, "reduce-overhead", compile=True, compile_mode="reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] > before


def test_regional_compilation_compiles_each_block_once_and_trains_the_eager_weights(tmp_path):
    """compile_regions=True: the three blocks share one compiled graph (traced once), the loss is
    compiled (traced once), the rest of the forward runs eagerly (every micro-batch)."""
    _, eager, _ = fit(tmp_path, Stack, "eager")
    assert (len(BLOCK_CALLS), len(LOSS_CALLS), len(FORWARD_CALLS)) == (3 * 8, 8, 8)
    for calls in (LOSS_CALLS, BLOCK_CALLS, FORWARD_CALLS):
        calls.clear()
    _, regions, result = fit(tmp_path, Stack, "regions", compile=True, compile_regions=True)
    assert (len(BLOCK_CALLS), len(LOSS_CALLS), len(FORWARD_CALLS)) == (1, 1, 8)
    torch.testing.assert_close(flat_params(regions), flat_params(eager), rtol=1e-10, atol=1e-10)
    assert result.compile_seconds > 0
    assert sorted(regions.state_dict()) == sorted(Stack().state_dict())  # names as they were


class MissingKeyInForward(Classifier):
    def forward(self, batch):
        return self.net(batch["features"])


class MissingKeyInLoss(Classifier):
    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["label"])


class ForwardReturnsNone(Classifier):
    def forward(self, batch):
        self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs["logits"], batch["y"])


class VectorLoss(Classifier):
    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"], reduction="none")


class MissingKeyInMetrics(Classifier):
    def metrics(self, outputs, batch):
        return {"accuracy": (outputs.argmax(-1) == batch["label"]).double().mean()}


@pytest.mark.parametrize("module,error,where", [
    (MissingKeyInForward, ll.DataError, "at step 1, micro-batch 0"),
    (MissingKeyInLoss, ll.DataError, "at step 1, micro-batch 0"),
    (ForwardReturnsNone, ll.ModuleContractError, "at step 1, micro-batch 0"),
    (VectorLoss, ll.ModuleContractError, "at step 1, micro-batch 0"),
    (MissingKeyInMetrics, ll.DataError, "in val batch 0")])
def test_the_compiled_step_raises_the_eager_errors(tmp_path, module, error, where):
    """The checks of what forward and loss return, and the errors that name a batch key the
    batch lacks (metrics(): in evaluation), are the eager step's, word for word."""
    val = DictDataset(n=4, dtype=torch.float64)
    with pytest.raises(error) as eager:
        fit(tmp_path, module, "eager", val, eval_every=1)
    with pytest.raises(error) as compiled:
        fit(tmp_path, module, "compiled", val, eval_every=1, compile=True)
    assert where in str(eager.value)
    assert str(compiled.value) == str(eager.value)


def test_compile_options_without_compile_and_unknown_modes_are_refused():
    with pytest.raises(ll.ConfigError, match=r"compile_mode='max-autotune', compile_regions=True set but "
                                             r"compile=False.*set compile=True, or drop them"):
        ll.FitConfig(compile_regions=True, compile_mode="max-autotune")
    with pytest.raises(ll.ConfigError, match=r"compile_mode='fast' is not valid.*default, reduce-overhead"):
        ll.FitConfig(compile=True, compile_mode="fast")
    assert ll.FitConfig(compile=True, compile_mode="max-autotune-no-cudagraphs", compile_dynamic=False).compile


class NamedBlocks(Classifier):
    """No nn.ModuleList: its blocks are named by compile_regions()."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 3))

    def compile_regions(self):
        return [self.net[1], self.net[2]]


def test_blocks_are_found_named_or_refused_by_name(tmp_path):
    from lightlike.blocks import find_blocks

    stack = Stack()
    assert find_blocks(stack) == list(stack.blocks)
    named = NamedBlocks()
    assert find_blocks(named) == [named.net[1], named.net[2]]
    with pytest.raises(ll.ConfigError, match=r"Classifier has no repeated blocks.*define compile_regions\(\)"):
        ll.Fitter(max_steps=1, compile=True, compile_regions=True, output_dir=str(tmp_path), loggers=[]).fit(
            Classifier(), DictDataset(n=4))


class NormBlock(Block):
    """A block with running statistics: the recompute must not update them a second time."""

    def __init__(self, width):
        super().__init__(width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        FORWARD_CALLS.append(1)
        return torch.tanh(self.norm(self.lin(x)))


class NormStack(Stack):
    def __init__(self, width=16):
        super().__init__(width=width)
        self.blocks = nn.ModuleList([NormBlock(width) for _ in range(2)])


def test_activation_checkpointing_per_block_on_one_device_trains_the_same_weights(tmp_path):
    """SingleDeviceStrategy(activation_checkpointing=True) recomputes each block in backward (its
    forward runs twice per micro-batch), with the same weights and running statistics. A later
    compiled fit of the module is refused by name (its blocks keep the eager hooks)."""
    _, plain, _ = fit(tmp_path, NormStack, "plain")
    plain_forwards = len(FORWARD_CALLS)
    FORWARD_CALLS.clear()
    _, ckpt, _ = fit(tmp_path, NormStack, "ckpt", strategy=SingleDeviceStrategy("cpu", activation_checkpointing=True))
    assert len(FORWARD_CALLS) == 2 * plain_forwards - 8  # (8 of them Stack.forward's own, not recomputed)
    for k, v in plain.state_dict().items():
        assert torch.equal(ckpt.state_dict()[k], v), k
    # its blocks hold the eager checkpoint's hooks, which torch.compile cannot trace: a compiled fit says so
    with pytest.raises(ll.ConfigError, match=r"checkpointed by hooks by an earlier fit of this module without compile"):
        ll.Fitter(max_steps=1, compile=True, output_dir=str(tmp_path / "again"), loggers=[], save_strategy="no",
                  strategy=SingleDeviceStrategy("cpu", activation_checkpointing=True)).fit(
            ckpt, DictDataset(n=4, dtype=torch.float64))


class QuietNormBlock(Block):
    """NormBlock without a Python side effect in forward: torch.compile traces a checkpoint only
    over code without one (else its graph breaks there and torch runs the checkpoint eagerly)."""

    def __init__(self, width):
        super().__init__(width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x)))


class QuietNormStack(Stack):
    def __init__(self, width=16):
        super().__init__(width=width)
        self.blocks = nn.ModuleList([QuietNormBlock(width) for _ in range(2)])


@contextlib.contextmanager
def saved_activations(rows: int = 4) -> Iterator[list[int]]:
    """Counts the tensors autograd saves for backward that hold one row per item of a 4-item
    micro-batch (activations; no parameter of these modules has 4 rows), compiled functions'
    included: a checkpointed block keeps only its input, and recomputes the rest in backward."""
    saved: list[int] = []

    def pack(t):
        if t.dim() and t.shape[0] == rows:
            saved.append(1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


@pytest.mark.parametrize("regions", [False, True])
def test_activation_checkpointing_per_block_works_under_compile(tmp_path, regions):
    """compile=True with per-block activation checkpointing was refused (the checkpoint's hooks
    broke the graph and torch's recomputation failed). Now each block is checkpointed in the form
    torch.compile traces, in the whole compiled step and in each compiled block: the weights and
    running statistics are those of the same compiled fit without checkpointing, bit for bit,
    fewer activations are kept for backward (the blocks' own are recomputed there), and the
    state_dict keys are the module's own."""
    options = dict(compile=True, compile_regions=regions)
    with saved_activations() as kept_plain:
        _, plain, _ = fit(tmp_path, QuietNormStack, "plain", **options)
    with saved_activations() as kept_ckpt:
        _, ckpt, _ = fit(tmp_path, QuietNormStack, "ckpt", strategy=SingleDeviceStrategy("cpu", activation_checkpointing=True),
                         **options)
    assert 0 < len(kept_ckpt) < len(kept_plain), (len(kept_ckpt), len(kept_plain))
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(ckpt.state_dict()[k], v), k
    assert int(ckpt.state_dict()["blocks.0.norm.num_batches_tracked"]) == 8  # once per micro-batch

"""FSDP2 (``fully_shard``) on real processes (torchrun, gloo, CPU): the same weights as DDP, half
the memory per rank on 2 ranks, kill-anywhere resume bit for bit, resharding 2→1 and 1→2 through
``torch.distributed.checkpoint``, export to one ``model.safetensors``, precisions, meta-device init."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import Classifier
from launching import FSDP_ARGS, REF_8_STEPS, assert_close, launch, moved_share, run_each_ok, run_ok, weights
from launching import FSDP_COMMON as COMMON
from launching import check_nan_gradient_on_one_rank as check_nan_gradient
from torch import nn

from lightlike.errors import CheckpointError, ConfigError
from lightlike.strategies import get_strategy
from lightlike.utils import toml

ROOT = Path(__file__).resolve().parents[2]
#: the DDP reference and the sharded runs compared with it (checkpoints at 2, 4, 6 and the last, 7);
#: launched once (``shared_run``) for every test that reads them
DDP_RUN = ["--strategy", "ddp", "--batch", "4", *COMMON]
#: the runs the tests below compare with the DDP reference, launched with it (one launch:
#: ``shared_run.each``) by whichever test asks first
SHARDED_RUNS = [["--strategy", "fsdp", *FSDP_ARGS], ["--strategy", "hsdp:1", *FSDP_ARGS],
                ["--strategy", "fsdp:async", *FSDP_ARGS], ["--strategy", "fsdp", "--batch", "4", *COMMON, "--rank-seed"]]


def _sharded(shared_run, args):
    """The output of ``args`` (one of SHARDED_RUNS, or DDP_RUN), launched with the others."""
    runs = [DDP_RUN, *SHARDED_RUNS]
    return shared_run.each(2, *runs)[runs.index(args)]


#: evaluations (validate and predict, no fit) on two ranks and the one-process references
EVAL = ["--mode", "eval", "--batch", "4", "--task", "blocks"]
TWO_RANK_EVALS = [[*EVAL, "--items", "9", "--strategy", "fsdp", "--rank-seed"], [*EVAL, "--items", "9", "--strategy", "fsdp"],
                  [*EVAL, "--items", "1", "--strategy", "fsdp"]]


def _evaluated(shared_run, items, strategy, *extra):
    """eval.json of one process's evaluation of ``items`` items, and of two ranks' (``strategy``, ``extra``)."""
    two = shared_run.each(2, *TWO_RANK_EVALS)[TWO_RANK_EVALS.index([*EVAL, "--items", str(items), "--strategy", strategy,
                                                                    *extra])]
    one = shared_run.each(1, [*EVAL, "--items", "9"], [*EVAL, "--items", "1"])[[9, 1].index(items)]
    return (json.loads((d / "eval.json").read_text()) for d in (one, two))


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp:1"])
def test_same_weights_as_ddp(shared_run, strategy):
    """FSDP (shard over 2) and HSDP (replicate 2 × shard 1) against DDP on 2 ranks, float64,
    with accumulation, norm clipping, uneven item counts and a partial last window: to 1e-12.
    The logged training loss is the same too."""
    ddp, fsdp = _sharded(shared_run, DDP_RUN), _sharded(shared_run, ["--strategy", strategy, *FSDP_ARGS])
    ref, got = weights(ddp), weights(fsdp)
    assert all(torch.equal(got[k], weights(fsdp, 1)[k]) for k in got), "ranks disagree"
    assert_close(got, ref, tol=1e-12)
    losses = [[json.loads(x)["train/loss"] for x in (d / "logs" / "metrics.jsonl").read_text().splitlines()
               if "train/loss" in x] for d in (ddp, fsdp)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)


def test_ranks_that_built_other_weights_start_from_rank_0s(shared_run):
    """Each rank seeds its module's build with its rank (rank 0 with 0, as the reference runs).
    DDP takes rank 0's weights as it wraps the module; FSDP kept each rank's own shard, a mix of
    two initialisations, in a fit and in a validate() outside one."""
    seeded = _sharded(shared_run, ["--strategy", "fsdp", "--batch", "4", *COMMON, "--rank-seed"])
    assert_close(weights(seeded), weights(_sharded(shared_run, DDP_RUN)), tol=1e-12)
    one, two = _evaluated(shared_run, 9, "fsdp", "--rank-seed")
    assert two["predictions"] == one["predictions"]
    for k, v in one["metrics"].items():
        assert two["metrics"][k] == pytest.approx(v, rel=1e-9), k


@pytest.mark.parametrize("strategy, items", [("fsdp", 9), ("fsdp", 1)])
def test_exact_evaluation_when_ranks_hold_different_numbers_of_batches(shared_run, strategy, items):
    """9 items in batches of 4 on 2 ranks: rank 0 takes 2 batches, rank 1 one (1 item: rank 1
    none). A sharded forward gathers parameters collectively, so the rank that is done must keep
    the other company (it aborted on a collective mismatch); metrics and predictions equal one
    process's. (ZeRO-3 takes the same path, ``forward_is_collective``; checked by hand in a fit
    with partitioned parameters, not here: a validate() without fit does not partition them.)"""
    one, two = _evaluated(shared_run, items, strategy)
    assert two["predictions"] == one["predictions"] and two["labels"] == one["labels"]
    for k, v in one["metrics"].items():
        assert two["metrics"][k] == pytest.approx(v, rel=1e-6), k


def test_a_module_left_sharded_by_fsdp_is_refused_by_ddp_by_name(tmp_path):
    """After an FSDP fit the module's parameters are DTensors; a DDP Fitter's predict() on it
    failed on every rank with a bare DTensor error ("Cannot flatten unevenly sharded tensor")."""
    run_ok(2, tmp_path, "--mode", "ddp-after-fsdp", "--items", "8", "--width", "5")
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "the module's parameters are sharded (DTensor" in text and "strategy='fsdp'" in text, text


def test_memory_per_rank_is_half_of_ddp(tmp_path):
    """Parameter + gradient + optimizer bytes held by each rank (its local shards), measured just
    before the last optimizer step: FSDP on 2 ranks ≤ (1/2 + 5 %) of DDP's."""
    args = ["--width", "256", "--steps", "2", "--items", "16", "--batch", "4", "--dtype", "float32"]
    run_each_ok(2, [(tmp_path / "ddp", ["--strategy", "ddp", *args]), (tmp_path / "fsdp", ["--strategy", "fsdp", *args])])
    for rank in (0, 1):
        ddp = json.loads((tmp_path / "ddp" / f"footprint-rank{rank}.json").read_text())
        fsdp = json.loads((tmp_path / "fsdp" / f"footprint-rank{rank}.json").read_text())
        assert ddp["grads"] == ddp["params"] and ddp["optimizer"] == 2 * ddp["params"] + 16  # AdamW: 2 moments + steps
        assert sum(fsdp.values()) <= 0.55 * sum(ddp.values()), (fsdp, ddp)
        assert fsdp["params"] > 0.45 * ddp["params"]  # a shard, not nothing


KILLS = [("fsdp", 3, "token"), ("fsdp", 6, "token"), ("fsdp:async", 5, "token"), ("fsdp", 5, "norm-blocks")]


def _kill_common(strategy, task):
    return ["--strategy", strategy, "--steps", "9", "--items", "40", "--batch", "4", "--accum", "2",
            "--save-every", "2", "--task", task, "--dtype", "float32"]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Each case of KILLS killed (a launch each: the kill ends it), then every resume and every
    uninterrupted reference in one launch: {case: (resumed folder, reference folder, killed rc)}."""
    base = tmp_path_factory.mktemp("kills")
    killed, runs, refs = {}, [], {}
    for strategy, kill_step, task in KILLS:
        common = _kill_common(strategy, task)
        out = base / f"{strategy.replace(':', '-')}-{kill_step}-{task}"
        killed[strategy, kill_step, task] = launch(2, out, *common, "--kill-step", str(kill_step)).returncode
        runs.append((out, [*common, "--resume"]))
        refs.setdefault((strategy, task), (base / f"ref-{strategy.replace(':', '-')}-{task}", common))
    run_each_ok(2, [*runs, *refs.values()])
    return {case: (out, refs[case[0], case[2]][0], killed[case]) for case, (out, _) in zip(KILLS, runs, strict=True)}


@pytest.mark.parametrize("strategy,kill_step,task", KILLS)
def test_kill_and_resume_is_bit_identical(killed_and_resumed, strategy, kill_step, task):
    """SIGKILL rank 1 after step 3 (mid-epoch) or 6 (past an epoch boundary); torchrun ends rank
    0; resume from the newest sharded checkpoint: the same weights and logs, bit for bit. With
    asynchronous saves, a checkpoint whose write was in flight at the kill is not committed and
    resume takes the one before. With BatchNorm in the shard units ("norm-blocks"), the buffers
    every rank holds: DCP wrote rank 1's copy, so the resumed rank 0 differed; the checkpoint
    holds rank 0's, which every rank takes at the save."""
    out, ref, killed = killed_and_resumed[strategy, kill_step, task]
    assert killed != 0
    for rank in (0, 1):
        a, b = weights(out, rank), weights(ref, rank)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank} differs"
    logs = [(d / "logs" / "metrics.jsonl").read_text() for d in (out, ref)]
    assert logs[0] == logs[1]


RESHARDS = [(2, 1, "fsdp"), (1, 2, "fsdp"), (2, 2, "ddp")]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Each case of RESHARDS stopped at step 4 and resumed, in three launches (not six): the
    2-rank stop, once, copied for each of its two resumes; then on one process the 1-rank stop
    and the 1-rank resume; then on two ranks both 2-rank resumes. {case: (folder, its checkpoint-4
    as the stop left it)}."""
    common = ["--steps", "8", "--items", "40", "--save-every", "4"]
    base = tmp_path_factory.mktemp("reshards")

    def stop(before):
        return ["--strategy", "fsdp", "--batch", str(8 // before), "--stop", "4", *common]

    def resume(after, strategy):
        return ["--strategy", strategy, "--batch", str(8 // after), "--resume", *common]

    outs = {case: base / "-".join(map(str, case)) for case in RESHARDS}
    stopped = base / "stopped-on-2"
    run_ok(2, stopped, *stop(2))
    for case in ((2, 1, "fsdp"), (2, 2, "ddp")):
        shutil.copytree(stopped, outs[case])
    run_each_ok(1, [(outs[1, 2, "fsdp"], stop(1)), (outs[2, 1, "fsdp"], resume(1, "fsdp"))])
    stops = {case: base / f"checkpoint-4-{'-'.join(map(str, case))}" for case in RESHARDS}
    for case in RESHARDS:  # as the stop left it (the resume adds checkpoint-8 beside it)
        shutil.copytree(outs[case] / "checkpoint-4" if case[0] == 1 else stopped / "checkpoint-4", stops[case])
    run_each_ok(2, [(outs[1, 2, "fsdp"], resume(2, "fsdp")), (outs[2, 2, "ddp"], resume(2, "ddp"))])
    return {case: (outs[case], stops[case]) for case in RESHARDS}


@pytest.mark.parametrize("before,after,resume_strategy", RESHARDS)
def test_resume_reshards(shared_run, resharded, before, after, resume_strategy):
    """Stop at step 4 on `before` FSDP ranks, resume on `after` ranks (same global batch): DCP
    reshards weights and AdamW state onto the new layout, and the run ends where the
    uninterrupted one does. The sharded checkpoint also resumes under DDP (same names)."""
    ref = shared_run(2, *REF_8_STEPS)
    out, stopped = resharded[before, after, resume_strategy]
    manifest = json.loads((stopped / "manifest.json").read_text())
    assert manifest["meta"]["state_format"] == "dcp"
    assert not (stopped / "model.safetensors").exists()  # sharded: nothing gathered
    assert_close(weights(out), weights(ref), tol=1e-10)


def test_export_consolidates_shards(shared_run, tmp_path):
    """``lightlike export`` on a sharded checkpoint writes one model.safetensors equal to the
    run's full weights, which loads into a fresh module."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    out = _sharded(shared_run, ["--strategy", "fsdp", *FSDP_ARGS])
    exported = tmp_path / "export"
    cli = subprocess.run([sys.executable, "-m", "lightlike.cli", "export", str(out / "checkpoint-7"), str(exported)],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    got, ref = load_file(str(exported / "model.safetensors")), weights(out)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    fresh = Classifier().double()
    fresh.load_weights(exported)
    assert torch.equal(fresh.net[0].weight, ref["net.0.weight"])
    with pytest.raises(CheckpointError, match="lightlike export"):
        Classifier().double().load_weights(out / "checkpoint-7")


PRECISIONS = ["bf16-mixed", "16-mixed", "bf16-true"]
PRECISION_ARGS = ["--strategy", "fsdp", "--dtype", "float32", "--batch", "4", "--steps", "6", "--items", "48"]
OWN_16_MIXED = ["--strategy", "fsdp:own-16-mixed", "--dtype", "float32", "--steps", "4"]
META_ARGS = ["--strategy", "fsdp", "--width", "64", "--steps", "3", "--batch", "4", "--dtype", "float32"]
#: the float32 FSDP runs of the tests below, launched together by whichever asks first
FLOAT32_RUNS = [PRECISION_ARGS, *([*PRECISION_ARGS, "--precision", p] for p in PRECISIONS), OWN_16_MIXED,
                META_ARGS, [*META_ARGS, "--meta"], [*META_ARGS, "--init-module"]]


def _float32(shared_run, args):
    return shared_run.each(2, *FLOAT32_RUNS)[FLOAT32_RUNS.index(args)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_precisions(shared_run, precision):
    """Each precision this CPU supports trains under FSDP: finite losses, ranks agree, and the
    result is close to the fp32 run (the low-precision error, not a different computation): within
    a share of how far training moved the weights, which untrained weights (share 1) fail."""
    low = _float32(shared_run, [*PRECISION_ARGS, "--precision", precision])
    got, ref = weights(low), weights(_float32(shared_run, PRECISION_ARGS))
    assert all(torch.equal(got[k], weights(low, 1)[k]) for k in got)
    for k in ref:
        assert torch.isfinite(got[k]).all()
        torch.testing.assert_close(got[k].float(), ref[k], atol=0.05, rtol=0.05)
    share, largest = moved_share(got, ref, 16)
    assert 0 < largest < 0.2  # 6 AdamW steps at 1e-2 from the initial weights computed here
    assert 0 < share < 0.25, share  # observed 0.027 (16-mixed) to 0.066 (bf16-true)
    losses = [json.loads(x)["train/loss"] for x in (low / "logs" / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    assert len(losses) == 6 and all(map(math.isfinite, losses))


def test_a_strategy_instance_with_its_own_16_mixed(shared_run):
    """FSDPStrategy(precision=MixedPrecision("16", init_scale=2**10, growth_interval=1)) with the
    Fitter's precision left 'auto': it trains (the optimizer is unfused for the ShardedGradScaler,
    as under precision='16-mixed'), and the ShardedGradScaler keeps the plugin's settings. Before,
    the fused kernel failed at step 1 and the scaler fell back to torch's defaults (2**16, 2000)."""
    out = _float32(shared_run, OWN_16_MIXED)
    scaler = json.loads((out / "scaler-rank0.json").read_text())
    assert scaler["class"] == "ShardedGradScaler" and scaler["growth_interval"] == 1
    assert scaler["scale"] == 2.0**14  # four finite steps, doubled after each
    assert torch.isfinite(weights(out)["net.0.weight"]).all()


def test_offload_on_cpu_is_a_clear_error(tmp_path):
    p = launch(2, tmp_path / "off", "--strategy", "fsdp_offload", "--steps", "1")
    assert p.returncode != 0
    assert "is on the CPU already; use strategy='fsdp'" in p.stderr


@pytest.mark.parametrize("how", ["--meta", "--init-module"])
def test_meta_device_init_materialises_shards(shared_run, how):
    """A module built on the meta device (by hand, or in ``fitter.init_module()``) is sharded
    first, then each rank allocates and initialises only its shard, with exactly the values of
    ``torch.manual_seed(seed); Model()``: the run is bit-identical to one with an eagerly built
    module (on the CPU, DTensor random ops would give every shard the same values)."""
    meta = _float32(shared_run, [*META_ARGS, how])
    w0, w1, eager = weights(meta, 0), weights(meta, 1), weights(_float32(shared_run, META_ARGS))
    assert w0["net.0.weight"].shape == (64, 8)
    for k in eager:
        assert torch.equal(w0[k], w1[k]) and torch.equal(w0[k], eager[k]), k


def test_meta_device_init_leaves_training_s_random_stream_alone(tmp_path):
    """Materialising a meta-built module draws its initial values in a forked generator: the
    dropout masks after it are an eager build's (without the fork the run differed by 4e-3; the
    test above trains no random layer). One process, in a subprocess (FSDP keeps its group)."""
    import subprocess
    import sys

    code = f"""
import sys, torch
from torch import nn
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import lightlike as ll
from helpers import Classifier, DictDataset

class Dropped(Classifier):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, batch):
        return self.net(self.drop(batch["x"]))

def run(meta, out):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            module = Dropped()
    else:
        module = Dropped()
    fitter = ll.Fitter(strategy="fsdp", max_steps=3, batch_size=4, seed=0, output_dir=out, loggers=[],
                       model_summary=False, save_strategy="no")
    fitter.fit(module, DictDataset(n=16))
    return fitter.strategy.checkpoint_layout.module_state_dict(fitter.model)

eager, meta = run(False, {str(tmp_path / "eager")!r}), run(True, {str(tmp_path / "meta")!r})
print(all(torch.equal(eager[k], meta[k]) for k in eager))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == "True"


CHECKPOINTED_TASKS = ["blocks", "maybe-checkpointed", "norm-blocks"]


@pytest.fixture(scope="module")
def checkpointing(tmp_path_factory):
    """Every task of CHECKPOINTED_TASKS with activation checkpointing and without, in one launch
    (each run counts its own block calls): its folder, and the launch's stderr."""
    base = tmp_path_factory.mktemp("checkpointing")
    runs = []
    for task in CHECKPOINTED_TASKS:
        args = ["--strategy", "fsdp", "--batch", "4", "--steps", "4", "--items", "32", "--task", task]
        runs += [(base / task / "plain", args), (base / task / "ckpt", [*args, "--gradient-checkpointing"])]
    return base, run_each_ok(2, runs).stderr


@pytest.mark.parametrize("task", CHECKPOINTED_TASKS)
def test_activation_checkpointing_gives_the_same_weights(checkpointing, task):
    """Activation checkpointing recomputes the forward in backward (counted: twice the forwards)
    and the numbers are the same as without it: applied to the shard units before sharding
    ("blocks"), or, for a module without units, by the module's own maybe_checkpoint (it used to
    be switched off there, so nothing was checkpointed; and the units' case warned falsely).
    "norm-blocks": units with BatchNorm, whose running statistics the recompute updated a second
    time (the weights file holds them)."""
    base, stderr = checkpointing
    a, b = weights(base / task / "plain"), weights(base / task / "ckpt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    calls = [int((base / task / d / "block-calls-rank0.txt").read_text()) for d in ("plain", "ckpt")]
    assert calls[0] > 0 and calls[1] == 2 * calls[0], calls
    assert "never called self.maybe_checkpoint" not in stderr  # in no run of the launch


# -- in-process: shard-unit choice and presets ------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])


def test_shard_units_default_by_name_and_callable():
    from lightlike.strategies.fsdp import FSDPStrategy

    m = Stack()
    assert FSDPStrategy()._units(m) == list(m.blocks)  # "...Block": the repeated layers
    assert FSDPStrategy(shard_units="Linear")._units(m) == [m.embed, m.blocks[0].inner, m.blocks[1].inner]
    assert FSDPStrategy(shard_units=lambda s: s is m.embed)._units(m) == [m.embed]
    with pytest.raises(ConfigError, match="matches no submodule class"):
        FSDPStrategy(shard_units="Blok")._units(m)


def _write(path, text):
    path.write_text(text)
    return path


def test_preset_files_agree_with_named_presets(tmp_path):
    """Every strategies/fsdp*.toml is the preset of the same name, loads, and lists every key a
    file may set (docs/strategies/index.md says so), each one accepted."""
    import re

    from lightlike.strategies.fsdp import FILE_KEYS, PRESETS, FSDPStrategy

    files = sorted((ROOT / "strategies").glob("*sdp*.toml"))
    assert {f.stem for f in files} == set(PRESETS)
    for f in files:
        listed = dict(re.findall(r"^#? ?(\w+) = (.*?)(?:\s+#.*)?$", f.read_text().split("[fsdp]")[1], re.M))
        assert sorted(listed) == sorted(FILE_KEYS), f.name
        uncommented = "\n".join(f"{k} = {v}" for k, v in listed.items() if k != "shard_units")
        FSDPStrategy.from_file(_write(tmp_path / f.name, f"[fsdp]\n{uncommented}\n"))  # each value is accepted
    fields = ("offload", "hybrid", "reshard_after_forward", "shard_units", "shard_size")
    for f in files:
        from_file, named = FSDPStrategy.from_file(f), FSDPStrategy.from_preset(f.stem)
        assert {k: getattr(from_file, k) for k in fields} == {k: getattr(named, k) for k in fields}, f.name
        assert toml.loads(f.read_text())["strategy"] == f.stem
        # a path works wherever a strategy name does (Fitter keyword, config file, --strategy)
        via_path = get_strategy(str(f), "cpu", None)
        assert {k: getattr(via_path, k) for k in fields} == {k: getattr(named, k) for k in fields}, f.name
    # the strategy line picks the preset the [fsdp] table refines
    short = tmp_path / "short.toml"
    short.write_text('strategy = "hsdp"\n[fsdp]\nreshard_after_forward = false\n')
    got = FSDPStrategy.from_file(short)
    assert (got.hybrid, got.offload, got.reshard_after_forward) == (True, False, False)
    bad = tmp_path / "bad.toml"
    bad.write_text("[fsdp]\noffload = true\nreshard = false\n")
    with pytest.raises(ConfigError, match="unknown \\[fsdp\\] keys"):
        FSDPStrategy.from_file(bad)
    (tmp_path / "zero.toml").write_text('strategy = "deepspeed_zero3"\n')
    with pytest.raises(ConfigError, match="describes FSDP"):
        get_strategy(str(tmp_path / "zero.toml"), "cpu", None)
    with pytest.raises(ConfigError, match="no such file"):
        get_strategy(str(tmp_path / "missing.json"), "cpu", None)


def test_async_save_commits_every_checkpoint(shared_run):
    """With async_save, every checkpoint is committed (the last at the end of the fit), verifies,
    and holds the same shards as a synchronous save of the same run."""
    from lightlike.checkpoint.manifest import list_checkpoints, verify_checkpoint

    sync = _sharded(shared_run, ["--strategy", "fsdp", *FSDP_ARGS])
    asynchronous = _sharded(shared_run, ["--strategy", "fsdp:async", *FSDP_ARGS])
    done = [p.name for p in list_checkpoints(asynchronous)]
    assert done == [p.name for p in list_checkpoints(sync)] == [f"checkpoint-{s}" for s in (2, 4, 6, 7)]
    for name in done:
        a = verify_checkpoint(asynchronous / name)["files"]
        b = verify_checkpoint(sync / name)["files"]
        shards = [f for f in b if f.startswith("dcp/__")]
        assert shards and all(a[f]["xxh3_128"] == b[f]["xxh3_128"] for f in shards), name


def test_meta_device_values_nothing_initialised_are_named(tmp_path):
    """A parameter of the module's own (no submodule's reset_parameters() sets it) and a buffer
    computed in __init__ kept whatever memory to_empty() gave them, and the fit trained on
    that. They are named instead; an init_weights() that sets them makes the fit go. One process,
    in a subprocess (FSDP keeps its group)."""
    import subprocess
    import sys

    code = f"""
import math, sys, torch
from torch import nn
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import lightlike as ll
from helpers import Classifier, DictDataset

class Scaled(Classifier):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("freq", torch.arange(8.0))
        self.register_buffer("pos", torch.arange(8))
        self.register_buffer("keep", torch.ones(8, dtype=torch.bool))
        self.register_buffer("missing", torch.zeros(8))
        self.register_buffer("nan", torch.zeros(2))  # not read by forward

    def forward(self, batch):
        return self.net(batch["x"] * self.scale * self.keep + self.freq + self.pos + self.missing)

class Initialised(Scaled):
    def init_weights(self):
        for m in self.net:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self.scale.fill_(1.0)
        self.freq.data.copy_(torch.arange(8.0))  # through .data, as Hugging Face's _init_weights writes
        self.pos.copy_(torch.arange(8))
        self.keep.fill_(True)
        self.missing.zero_()
        self.nan.fill_(float("nan"))  # NaN on purpose is a value

class SetsInPart(Initialised):
    def init_weights(self):
        super().init_weights()
        self.missing.fill_(float("nan"))
        self.missing[:4] = 0.0

class Replaces(Initialised):
    def init_weights(self):
        super().init_weights()
        self.scale = nn.Parameter(torch.ones(8))

def fit(cls, out):
    with torch.device("meta"):
        module = cls()
    fitter = ll.Fitter(strategy="fsdp", max_steps=2, batch_size=4, output_dir=out, loggers=[], model_summary=False,
                       save_strategy="no")
    result = fitter.fit(module, DictDataset(n=16))
    return result, fitter.strategy.checkpoint_layout.module_state_dict(fitter.model)

for cls in (Scaled, SetsInPart, Replaces):
    try:
        fit(cls, {str(tmp_path / "a")!r})
    except ll.ConfigError as e:
        print("ERROR", e)
result, state = fit(Initialised, {str(tmp_path / "b")!r})
print("OK", math.isfinite(result.training_loss), state["freq"].tolist() == list(range(8)))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    errors = [line for line in p.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 3, p.stdout
    assert ("any submodule's reset_parameters() did not set freq, keep (still all False: if written through .data, "
            "write it in place), missing, nan, pos (still holds the largest integer: if written through .data, "
            "write it in place) ... (6 in all)") in errors[0], errors[0]
    assert "its init_weights() did not set missing (set in part) (1 in all)" in errors[1], errors[1]
    assert "its init_weights() did not set scale (replaced) (1 in all)" in errors[2], errors[2]
    assert p.stdout.splitlines()[-1] == "OK True True", p.stdout


def test_a_nan_gradient_on_one_rank_is_skipped_or_raised_on_every_rank(tmp_path):
    """The global norm over the shards (a DTensor reduced over the mesh) is NaN on every rank when
    rank 1's gradient is: both ranks skip the step, or both raise naming step 3 (as DDP's)."""
    check_nan_gradient(tmp_path, "fsdp")

"""DeepSpeed ZeRO (stages 1-3, offload) on real processes (torchrun, gloo, CPU) against DDP: the same
weights, half the memory per rank under ZeRO-3, kill-anywhere resume bit for bit, resume 2→1
through DeepSpeed's universal checkpoint, export to one ``model.safetensors``, precisions, and the
generated DeepSpeed config (user configs, presets).

Runs go through ``scripts/zero_target.py``: ``ddp_target.py``'s training run (same model, data and
outputs) plus a linear warm-up/decay schedule and weight decay (so the LR DeepSpeed steps with
and per-group settings are checked too) and a memory probe just before each optimizer step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Classifier
from launching import check_nan_gradient_on_one_rank as check_nan_gradient
from launching import launch as ddp_launch
from launching import launch_each, moved_share, weights

from lightlike import FitConfig
from lightlike import errors as ll_errors
from lightlike.checkpoint.manifest import verify_checkpoint
from lightlike.errors import ConfigError

deepspeed = pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parents[1] / "scripts" / "zero_target.py"
#: float32, a partial last batch and a partial last window (38 items on 2 ranks x batch 4: batches of
#: 4,4,4,4,3 per rank and epoch, windows of 2,2,1: 3 steps an epoch), norm clipping, warm-up then
#: linear decay, weight decay (two param groups)
COMMON = ["--dtype", "float32", "--width", "256", "--items", "38", "--batch", "4", "--accum", "2",
          "--max-grad-norm", "0.5", "--steps", "7", "--schedule", "linear", "--warmup", "2",
          "--weight-decay", "0.1"]
SAVES = ["--save-every", "2"]
#: float32 agreement with DDP; observed: max |difference| 6e-8 (DeepSpeed's clip factor and
#: reduction order differ from DDP's in the last bits)
TOL = 1e-6
PRESETS = ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3",
           "deepspeed_zero3_offload"]


def launch(nproc, out, *args, timeout=240):
    return ddp_launch(nproc, out, *args, timeout=timeout, script=SCRIPT)


def run_ok(nproc, out, *args):
    p = launch(nproc, out, *args)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def log_rows(out):
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines() if "train/loss" in x]


def footprint(out, rank, when="step"):
    name = f"footprint-step-rank{rank}.json" if when == "step" else f"footprint-rank{rank}.json"
    return json.loads((out / name).read_text())


def assert_close(a, b, tol=TOL):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32, k
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def run_each_ok(nproc, runs):
    p = launch_each(nproc, runs, script=SCRIPT)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def bf16_mixed(stage):
    return ["--strategy", f"deepspeed_zero{stage}", "--precision", "bf16-mixed", *COMMON]


@pytest.fixture(scope="module")
def runs(shared_run, no_persistence):
    """Uninterrupted 2-process runs with COMMON (``shared_run``: each launched once, when first
    asked for). The first call launches every run of this file's tests at once (one launch, one
    run after another: ``--then``), a launch costing more than most runs here."""
    known = [("ddp",), *((p,) for p in PRESETS),
             ("deepspeed_zero3", "--ds-config", no_persistence, "--init-module"),
             ("deepspeed_zero3", "--ds-config", no_persistence, "--roundtrip"),
             ("deepspeed_zero2", "--precision", "bf16-true", "--roundtrip"), ("deepspeed_zero2", "--task", "norm-blocks"),
             ("deepspeed_zero1", "--task", "frozen-first"), ("deepspeed_zero3", "--task", "frozen-first"),
             ("deepspeed_zero2", "--task", "only-module")]

    def args(strategy, *extra):
        return ["--strategy", strategy, *COMMON, *SAVES, *extra]

    def get(strategy, *extra):
        if (strategy, *extra) in known:
            shared_run.each(2, *(args(*k) for k in known), *(bf16_mixed(stage) for stage in (1, 2, 3)), script=SCRIPT)
        return shared_run(2, *args(strategy, *extra), script=SCRIPT)

    get.bf16_mixed = lambda stage: shared_run.each(  # type: ignore[attr-defined]
        2, *(args(*k) for k in known), *(bf16_mixed(s) for s in (1, 2, 3)), script=SCRIPT)[len(known) + stage - 1]
    return get


@pytest.fixture(scope="module")
def no_persistence(tmp_path_factory):
    """A user DeepSpeed config: partition every ZeRO-3 parameter, however small."""
    path = tmp_path_factory.mktemp("cfg") / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    return str(path)


# -- equivalence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", PRESETS)
def test_same_weights_as_ddp(runs, strategy):
    """Every preset against DDP on 2 ranks after 7 steps in float32, with accumulation (a partial
    last window), norm clipping, warm-up + linear decay and weight decay: weights to 1e-6; the
    logged loss, learning rate and gradient norm (filled in after DeepSpeed's step) match too."""
    ddp, zero = runs("ddp"), runs(strategy)
    got = weights(zero)
    assert all(torch.equal(got[k], weights(zero, 1)[k]) for k in got), "ranks disagree"
    assert_close(got, weights(ddp))
    ref_rows, rows = log_rows(ddp), log_rows(zero)
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["train/lr"] for r in rows] == [r["train/lr"] for r in ref_rows]
    assert len({r["train/lr"] for r in rows}) > 3  # the schedule moves: a wrong LR would show in the weights
    for key, rel in (("train/loss", 1e-6), ("train/grad_norm", 1e-5)):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref_rows], rel=rel), key


def test_zero3_init_module_partitions_while_building(runs, no_persistence):
    """``with fitter.init_module():`` under ZeRO-3 is ``deepspeed.zero.Init``: each rank holds only
    its partition of every parameter from construction on; the initial weights are those of a
    plain build (same seed), so training still matches DDP."""
    ddp, zero3 = runs("ddp"), runs("deepspeed_zero3", "--ds-config", no_persistence, "--init-module")
    assert_close(weights(zero3), weights(ddp))
    for rank in (0, 1):
        ref, got = footprint(ddp, rank), footprint(zero3, rank)
        assert got["params"] <= 0.55 * ref["params"], (got, ref)


def test_zero3_memory_per_rank_is_half_of_ddp(runs, no_persistence):
    """Parameter + gradient + optimizer bytes each rank holds (its local partitions), measured just
    before every optimizer step (largest kept) and after the run: ZeRO-3 on 2 ranks ≤ (1/2 + 5 %)
    of DDP's. DeepSpeed keeps parameters smaller than ``stage3_param_persistence_threshold``
    (default 1e5 elements: all of this model's) whole on every rank, so this run sets it to 0 through
    a user config; the default run shows the whole parameters in its count."""
    ddp, zero3 = runs("ddp"), runs("deepspeed_zero3", "--ds-config", no_persistence, "--roundtrip")
    assert_close(weights(zero3), weights(ddp))
    for rank in (0, 1):
        for when in ("step", "end"):
            ref, got = footprint(ddp, rank, when), footprint(zero3, rank, when)
            assert ref["params"] == ref["grads"] == 3075 * 4 and ref["optimizer"] >= 2 * ref["params"], ref
            assert sum(got.values()) <= 0.55 * sum(ref.values()), (when, got, ref)
            for part in ("params", "grads", "optimizer"):
                assert 0.45 * ref[part] < got[part] <= 0.55 * ref[part], (when, part, got, ref)
        persistent = footprint(runs("deepspeed_zero3"), rank)
        assert persistent["params"] > 1.4 * footprint(zero3, rank)["params"]  # partition + whole copies


def roundtrip(out, rank):
    return json.loads((out / f"roundtrip-rank{rank}.json").read_text())


def test_setting_full_weights_reaches_master_and_parameters(runs, no_persistence):
    """``load_module_state_dict`` (used for weights-only loads such as ``load_best_at_end``) sets
    the fp32 master partitions (read back exactly) and the parameters the forward pass uses, also
    for a ZeRO-3 parameter whose size does not divide by the world size (the 3-element bias) and
    for bf16 parameters with fp32 masters; putting the trained weights back restores them exactly
    (the final weights of both runs are still checked against DDP's elsewhere)."""
    zero3 = runs("deepspeed_zero3", "--ds-config", no_persistence, "--roundtrip")
    bf16 = runs("deepspeed_zero2", "--precision", "bf16-true", "--roundtrip")
    for out in (zero3, bf16):
        for rank in (0, 1):
            r = roundtrip(out, rank)
            assert r["read_back_equal"] and r["restored_equal"], r
            assert r["forward_max_diff"] <= 1e-6, r  # against a plain module of the same dtype


# -- resume ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Three runs killed after step 5 (a launch each: the kill ends it): ZeRO-2, ZeRO-3, and ZeRO-2
    with BatchNorm; then all three resumes in one launch (``--then``). {case: (folder, killed rc,
    checkpoint-4 written and checkpoint-6 not, at the kill)}."""
    base = tmp_path_factory.mktemp("kills")
    cases = {"deepspeed_zero2": ["--strategy", "deepspeed_zero2", *COMMON, *SAVES],
             "deepspeed_zero3": ["--strategy", "deepspeed_zero3", *COMMON, *SAVES],
             "norm-blocks": ["--strategy", "deepspeed_zero2", *COMMON, *SAVES, "--task", "norm-blocks"]}
    got = {}
    for case, args in cases.items():
        out = base / case
        rc = launch(2, out, *args, "--kill-step", "5").returncode
        got[case] = (out, rc, (out / "checkpoint-4" / "deepspeed_meta.json").is_file()
                     and not (out / "checkpoint-6").exists())
    run_each_ok(2, [(base / case, [*args, "--resume"]) for case, args in cases.items()])
    return got


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_kill_and_resume_is_bit_identical(runs, killed_and_resumed, strategy):
    """SIGKILL rank 1 after step 5 (torchrun ends rank 0), resume on 2 processes from checkpoint-4
    (one step into the second epoch: DeepSpeed's own partition files plus lightlike's RNG/data/scheduler state): the
    same weights on both ranks, bit for bit, and the same log as the uninterrupted run."""
    ref = runs(strategy)
    out, killed, checkpoints_at_kill = killed_and_resumed[strategy]
    assert killed != 0
    assert checkpoints_at_kill  # checkpoint-4 (DeepSpeed's files), not checkpoint-6
    for rank in (0, 1):
        a, b = weights(out, rank), weights(ref, rank)
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank} differs"
    assert (out / "logs" / "metrics.jsonl").read_text() == (ref / "logs" / "metrics.jsonl").read_text()


def test_kill_and_resume_with_buffers_is_bit_identical(runs, killed_and_resumed):
    """BatchNorm statistics, which DeepSpeed leaves to each rank: the checkpoint holds rank 0's
    module state, so the resumed rank 1 differed from the uninterrupted one (until an evaluation
    gave it rank 0's). Every rank takes rank 0's buffers at a save."""
    ref = runs("deepspeed_zero2", "--task", "norm-blocks")
    out, killed, _ = killed_and_resumed["norm-blocks"]
    assert killed != 0
    for rank in (0, 1):
        a, b = weights(out, rank), weights(ref, rank)
        assert [k for k in a if not torch.equal(a[k], b[k])] == [], f"rank {rank} differs"


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_resume_two_ranks_on_one(runs, tmp_path, strategy):
    """Checkpoint-4 of a 2-rank run, resumed on 1 process with the same global batch (8): the
    ZeRO partitions are converted to DeepSpeed's universal checkpoint and re-partitioned, weights
    *and* Adam moments/steps/per-group settings carry over, so the run ends where the 2-rank run
    does, to float rounding (re-initialised moments would miss by ~1e-3; under ZeRO-3 this also
    checks lightlike's repairs of DeepSpeed's universal load: per-group weight decay, step counters)."""
    ref = runs(strategy)
    out = tmp_path / "one"
    out.mkdir()
    shutil.copytree(ref / "checkpoint-4", out / "checkpoint-4")
    args = [*COMMON, *SAVES]
    args[args.index("--batch") + 1] = "8"
    p = run_ok(1, out, "--strategy", strategy, *args, "--resume")
    assert "converting it to DeepSpeed's universal checkpoint format" in p.stderr
    assert_close(weights(out), weights(ref), tol=TOL)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name], "the conversion's temp directory was left"
    files = [sorted(q.relative_to(d).as_posix() for q in d.rglob("*")) for d in (ref / "checkpoint-4", out / "checkpoint-4")]
    assert files[0] == files[1]
    verify_checkpoint(out / "checkpoint-4", hashes=True)  # read, not modified


@pytest.fixture(scope="module")
def saved_and_resumed_on_one(tmp_path_factory):
    """For ZeRO-2 and ZeRO-3: a 2-rank run with BatchNorm saved at its last step (both in one
    launch), its checkpoint-3 resumed on one process (both in one launch). {strategy: (saved, resumed)}."""
    args = ["--dtype", "float32", "--items", "24", "--accum", "1", "--steps", "3", "--save-every", "3",
            "--task", "norm-blocks"]
    base = tmp_path_factory.mktemp("buffers")
    strategies = ["deepspeed_zero2", "deepspeed_zero3"]
    run_each_ok(2, [(base / s / "two", ["--strategy", s, "--batch", "4", *args]) for s in strategies])
    for s in strategies:
        (base / s / "one").mkdir()
        shutil.copytree(base / s / "two" / "checkpoint-3", base / s / "one" / "checkpoint-3")
    run_each_ok(1, [(base / s / "one", ["--strategy", s, "--batch", "8", *args, "--resume"]) for s in strategies])
    return {s: (base / s / "two", base / s / "one") for s in strategies}


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_resume_on_another_world_size_keeps_the_buffers(saved_and_resumed_on_one, strategy):
    """DeepSpeed's universal load restores parameters and optimizer state only: BatchNorm's
    running statistics and batch count came back at their constructor values (0, 1, 0). Resumed
    on one process with nothing left to train, the module holds exactly what was saved."""
    saved, out = saved_and_resumed_on_one[strategy]
    want, got = weights(saved), weights(out)
    assert [int(want[k]) for k in want if k.endswith("num_batches_tracked")] == [3, 3]  # trained statistics
    for k in want:
        assert torch.equal(got[k], want[k]), k


# -- export ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_export_gives_the_final_weights(runs, tmp_path, strategy):
    """``export_weights`` on the final checkpoint consolidates the ZeRO partitions (DeepSpeed's
    zero-to-fp32, streamed into one safetensors file): exactly the run's final fp32 weights, with
    the user module's keys, loadable into a fresh module."""
    from safetensors.torch import load_file

    from lightlike.checkpoint.export import export_weights

    out = runs(strategy)
    ckpt = out / "checkpoint-7"
    assert json.loads((ckpt / "manifest.json").read_text())["meta"]["state_format"] == "deepspeed"
    assert not (ckpt / "model.safetensors").exists()
    path = export_weights(ckpt, tmp_path / "export")
    exported, final = load_file(str(path)), weights(out)
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[k], final[k]) for k in final)
    fresh = Classifier(width=256)
    fresh.load_weights(tmp_path / "export")
    assert all(torch.equal(fresh.state_dict()[k], final[k]) for k in final)


class Payload:
    """What a crafted pickle holds: unpickling it creates ``marker`` (any code could run there)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def reseal(ckpt, rel):
    """Rewrite the manifest entry of ``rel`` for its new contents, as a forger would."""
    from lightlike.checkpoint.manifest import CHECKSUM, file_hash

    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["files"][rel]
    entry.clear()
    entry.update(size=(ckpt / rel).stat().st_size, **{CHECKSUM: file_hash(ckpt / rel)})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("strategy, victim", [("deepspeed_zero2", "mp_rank_00_model_states.pt"),
                                              ("deepspeed_zero3", "zero_pp_rank_1_mp_rank_00_optim_states.pt")])
def test_a_deepspeed_file_with_a_pickled_payload_is_refused_before_it_runs(runs, tmp_path, strategy, victim):
    """A checkpoint whose DeepSpeed files were replaced by a pickle that runs code, its manifest
    re-sealed: export (API and command line) and a weights load refuse it by file name, and the
    payload never runs. DeepSpeed's own readers unpickle anything (``weights_only=False``), so the
    files are read first with ``weights_only=True`` and DeepSpeed's few classes allowed. The same
    files as the run wrote them pass that reading (the other DeepSpeed tests resume and export them)."""
    from lightlike.checkpoint.export import export_weights
    from lightlike.checkpoint.zero import check_deepspeed_files, consolidated_state_dict

    ckpt = tmp_path / "checkpoint-7"
    shutil.copytree(runs(strategy) / "checkpoint-7", ckpt)
    check_deepspeed_files(ckpt / "deepspeed")  # DeepSpeed's own files: allowed
    marker = tmp_path / "payload-ran"
    rel = f"deepspeed/state/{victim}"
    torch.save({"module": Payload(marker)}, ckpt / rel)
    reseal(ckpt, rel)
    verify_checkpoint(ckpt)  # the forgery passes the checksums: only the reading can refuse it
    for attempt in (lambda: export_weights(ckpt, tmp_path / "export"), lambda: consolidated_state_dict(ckpt)):
        with pytest.raises(ll_errors.CheckpointError, match=f"{victim} holds more than DeepSpeed's checkpoint files hold"):
            attempt()
    p = subprocess.run([sys.executable, "-m", "lightlike", "export", str(ckpt), str(tmp_path / "cli")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode != 0 and f"{victim} holds more than" in p.stderr, p.stderr[-2000:]
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())


@pytest.mark.parametrize("strategy", ["deepspeed_zero1", "deepspeed_zero3"])
def test_export_keeps_frozen_parameters(runs, tmp_path, strategy):
    """A frozen layer (requires_grad False) was left out of a ZeRO-1 checkpoint's export and of
    its weights-only load (load_best_at_end then failed on every rank at the end of the fit):
    DeepSpeed records frozen parameters for its zero-to-fp32 reader only at stage 2 and up; they
    are whole in the module states file."""
    from safetensors.torch import load_file

    from lightlike.checkpoint.export import export_weights
    from lightlike.checkpoint.zero import consolidated_state_dict

    out = runs(strategy, "--task", "frozen-first")
    final, ckpt = weights(out), out / "checkpoint-7"
    assert "net.0.weight" in final
    exported = load_file(str(export_weights(ckpt, tmp_path / "export")))
    loaded = consolidated_state_dict(ckpt)
    for got in (exported, loaded):
        assert sorted(got) == sorted(final)
        assert all(torch.equal(got[k], final[k]) for k in final)


def test_a_submodule_named_module_keeps_its_name(runs, tmp_path):
    """Consolidation stripped "module." from every key, then (a first fix) from keys that all
    carried it: a module whose only submodule is named `module` still lost the name (export keys
    wrong, its weights-only load failed). The engine's names are the module's own: none is cut."""
    from safetensors.torch import load_file

    from lightlike.checkpoint.export import export_weights

    out = runs("deepspeed_zero2", "--task", "only-module")
    final = weights(out)
    assert sorted(final) == ["module.0.bias", "module.0.weight", "module.2.bias", "module.2.weight"]
    exported = load_file(str(export_weights(out / "checkpoint-7", tmp_path / "export")))
    assert sorted(exported) == sorted(final) and all(torch.equal(exported[k], final[k]) for k in final)


# -- precision -------------------------------------------------------------------------------------
def test_bf16_mixed_with_each_stage(runs):
    """bf16-mixed (DeepSpeed's torch_autocast section) with ZeRO-1, 2, 3: the first loss is the
    same bf16 forward on every stage and differs from the fp32 run's; training stays near the fp32
    weights; 32-true is every other test here."""
    ref = runs("ddp")
    first = {}
    for stage in (1, 2, 3):
        out = runs.bf16_mixed(stage)  # launched with the other runs
        got = weights(out)
        assert all(torch.equal(got[k], weights(out, 1)[k]) for k in got), "ranks disagree"
        assert_close(got, weights(ref), tol=0.05)
        share, largest = moved_share(got, weights(ref), 256)
        assert 0 < largest < 0.2  # 7 AdamW steps from the initial weights computed here
        assert 0 < share < 0.05, (stage, share)  # observed 0.0086 on each stage; untrained weights: 1
        first[stage] = log_rows(out)[0]["train/loss"]
    fp32 = log_rows(ref)[0]["train/loss"]
    assert first[1] == first[2] == first[3] != fp32
    assert first[1] == pytest.approx(fp32, rel=1e-2)


def test_bf16_true_keeps_bf16_params_and_fp32_master(runs):
    """bf16-true (DeepSpeed's bf16 section): the module's parameters are bf16 (half the bytes of the
    fp32 run's), the optimizer steps fp32 master partitions, whose exact values are the weights
    returned (float32)."""
    out = runs("deepspeed_zero2", "--precision", "bf16-true", "--roundtrip")
    fp32 = runs("deepspeed_zero2")
    assert footprint(out, 0)["params"] * 2 == footprint(fp32, 0)["params"]
    assert footprint(out, 0)["optimizer"] == footprint(fp32, 0)["optimizer"]  # fp32 master + moments
    assert_close(weights(out), weights(runs("ddp")), tol=0.05)


def test_float16_on_this_cpu_is_a_config_error(tmp_path):
    """DeepSpeed's CPU accelerator has no float16 here: 16-mixed fails before training, naming the
    precision and the strategy (one process: the same check runs on every rank)."""
    from lightlike.strategies.deepspeed_config import precision_sections

    p = launch(1, tmp_path / "fp16", "--strategy", "deepspeed_zero2", "--precision", "16-mixed", "--steps", "1",
               "--dtype", "float32")
    assert p.returncode != 0
    assert "ConfigError: precision='16-mixed' with strategy='deepspeed_zero2'" in p.stderr, p.stderr[-3000:]
    with pytest.raises(ConfigError, match="precision='16-true' with strategy='deepspeed_zero3'"):
        precision_sections("16-true", fp16_ok=False, device="cpu", strategy="deepspeed_zero3")
    assert precision_sections("16-true", fp16_ok=True, device="cuda:0", strategy="s")["fp16"] == {"enabled": True}


def test_float16_autocast_is_refused_where_float16_runs():
    """DeepSpeed 0.19.8's torch_autocast float16 path (where float16 runs: a GPU; shown on this CPU
    with its accelerator made to claim float16) skipped every step after one overflow (its
    GradScaler's update() is skipped on overflow) and clipped scaled gradients: refused, naming the
    precisions that work."""
    from lightlike.strategies.deepspeed_config import precision_sections

    with pytest.raises(ConfigError, match="precision='16-mixed' with strategy='deepspeed_zero2'.*'16-true'.*'bf16-mixed'"):
        precision_sections("16-mixed", fp16_ok=True, device="cuda:0", strategy="deepspeed_zero2")
    assert precision_sections("bf16-mixed", fp16_ok=True, device="cuda:0", strategy="s")["torch_autocast"] == \
        {"enabled": True, "dtype": "bfloat16"}


def test_a_float64_module_is_refused(tmp_path):
    """DeepSpeed keeps float32 master partitions: a float64 module trained at float32 precision
    without a word (3 ranks against 1 with 3x the batch: 7e-8 apart, FSDP 8e-17) and its weights
    came out float32. One ConfigError naming the strategies that train float64. (In a subprocess:
    the strategy sets up a process group.)"""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import pytest, torch
import lightlike as ll
from helpers import Classifier, DictDataset
data = DictDataset(n=16, dtype=torch.float64)
fitter = ll.Fitter(strategy="deepspeed_zero2", max_steps=2, batch_size=4, output_dir={str(tmp_path)!r}, loggers=[])
with pytest.raises(ll.ConfigError, match="trains torch.float64 parameters in float32.*'fsdp' or 'ddp'"):
    fitter.fit(Classifier().double(), data)
print("OK")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-2000:] + p.stderr[-3000:]


# -- the generated config ---------------------------------------------------------------------------
FIT = FitConfig(max_steps=5, batch_size=4, grad_accum_steps=2, max_grad_norm=0.5)


def test_generated_config_follows_the_fitter():
    from lightlike.strategies.deepspeed import DeepSpeedStrategy

    cfg = DeepSpeedStrategy(stage=3, offload_optimizer=True).build_config(FIT, world_size=2)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_batch_size"] == 16 and cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert "optimizer" not in cfg and "scheduler" not in cfg
    assert not any(cfg[k]["enabled"] for k in ("bf16", "fp16", "torch_autocast"))
    assert DeepSpeedStrategy().build_config(FitConfig(max_steps=1), 1)["gradient_clipping"] == 0.0


def test_user_config_that_contradicts_lightlike_is_an_error(tmp_path):
    from lightlike.strategies.deepspeed import DeepSpeedStrategy

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu: .* says 8 but lightlike generates 4"):
        DeepSpeedStrategy(config=str(user)).build_config(FIT, 2)
    for bad, match in (({"gradient_clipping": 1.0}, r"gradient_clipping: .* says 1.0 but lightlike generates 0.5"),
                       ({"bf16": {"enabled": True}}, r"bf16.enabled: .* says True but lightlike generates False"),
                       ({"gradient_accumulation_steps": 4}, r"says 4 but lightlike generates 2")):
        with pytest.raises(ConfigError, match=match):
            DeepSpeedStrategy(config=bad).build_config(FIT, 2)
    with pytest.raises(ConfigError, match=r"DeepSpeedStrategy\(stage=2\) contradicts zero_optimization.stage .* stage=3"):
        DeepSpeedStrategy(stage=2, config=str(user))
    for section in ("optimizer", "scheduler"):
        with pytest.raises(ConfigError, match=f"has an '{section}' section"):
            DeepSpeedStrategy(config={section: {"type": "AdamW"}})
    with pytest.raises(ConfigError, match="max_grad_value"):
        DeepSpeedStrategy().configure(FitConfig(max_steps=1, max_grad_value=1.0))
    with pytest.raises(ConfigError, match=r"compile=True is not supported .*engine.compile\(\) compiles the module's "
                                          r"forward alone, not the loss"):
        DeepSpeedStrategy().configure(FitConfig(max_steps=1, compile=True))
    # agreeing and "auto" values pass; keys lightlike does not generate are kept
    ok = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.5,
          "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": 0}}
    cfg = DeepSpeedStrategy(config=ok).build_config(FIT, 2)
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": 0}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_files_agree_with_the_named_presets(name):
    """``strategies/<name>.json`` (copyable, "auto" where lightlike fills in) means the same as
    ``strategy=<name>``: the same stage and offloads, the same generated DeepSpeed config."""
    from lightlike.strategies import get_strategy
    from lightlike.strategies.deepspeed import DeepSpeedStrategy

    path = ROOT / "strategies" / f"{name}.json"
    from_file, preset = DeepSpeedStrategy(config=str(path)), get_strategy(name, "auto", None)
    via_path = get_strategy(str(path), "auto", None)  # strategy="strategies/<name>.json", --strategy too
    assert isinstance(preset, DeepSpeedStrategy) and preset.name == name
    assert from_file.name == name and from_file.settings == preset.settings
    assert via_path.name == name and via_path.settings == preset.settings
    for precision in ("32-true", "bf16-mixed"):
        from lightlike.precision import get_precision

        from_file.precision = preset.precision = get_precision(precision)
        assert from_file.build_config(FIT, 2) == preset.build_config(FIT, 2)


def test_every_deepspeed_file_is_a_preset():
    files = sorted(p.stem for p in (ROOT / "strategies").glob("deepspeed_*.json"))
    assert files == sorted(PRESETS)


def test_import_lightlike_does_not_import_deepspeed():
    code = ("import sys, lightlike\nfrom lightlike.strategies.deepspeed import DeepSpeedStrategy\n"
            "s = DeepSpeedStrategy(config='strategies/deepspeed_zero3.json')\n"
            "assert s.stage == 3 and s.name == 'deepspeed_zero3'\n"
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]


def test_evaluating_a_zero3_partitioned_module_without_fit_is_a_clear_error(tmp_path):
    """Built in init_module() under ZeRO-3, then validate() without fit(): the forward ran on the
    empty partitions ('mat2 must be a matrix'). One error saying what to do instead."""
    p = launch(2, tmp_path / "v", "--strategy", "deepspeed_zero3", "--mode", "eval", "--init-module", "--items", "9",
               "--dtype", "float32", "--width", "400")
    assert p.returncode != 0
    assert "built in fitter.init_module() under ZeRO-3" in p.stderr and "evaluate it after fit()" in p.stderr, \
        p.stderr[-3000:]


def copied_checkpoint(run, out, name="checkpoint-2"):
    """``out`` holding a copy of a shared run's checkpoint, to resume from (the run stays as it is)."""
    out.mkdir()
    shutil.copytree(run / name, out / name)
    return out


def test_moves_the_universal_checkpoint_cannot_make_are_refused_by_name(runs, tmp_path):
    """ZeRO-2 -> ZeRO-3 (DeepSpeed failed on a bare AssertionError: the model-state file names
    differ) and SGD across world sizes (KeyError: 'exp_avg' inside the conversion): each one
    clear error before anything is loaded."""
    out = copied_checkpoint(runs("deepspeed_zero2"), tmp_path / "z2")
    p = launch(2, out, "--strategy", "deepspeed_zero3", *COMMON, *SAVES, "--resume")
    assert p.returncode != 0
    assert "saved with ZeRO-2 and this run uses ZeRO-3" in p.stderr, p.stderr[-3000:]
    short = ["--dtype", "float32", "--width", "16", "--items", "32", "--batch", "4", "--steps", "4",
             "--save-every", "2"]
    run_ok(2, tmp_path / "sgd", "--strategy", "deepspeed_zero2", "--optimizer", "sgd", *short, "--stop", "2")
    p = launch(1, tmp_path / "sgd", "--strategy", "deepspeed_zero2", "--optimizer", "sgd", *short, "--resume")
    assert p.returncode != 0
    assert "carries Adam-family state only, not SGD's" in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_resume_one_rank_on_two(runs, tmp_path, strategy):
    """The other direction: a 1-process run (batch 8) stopped after its checkpoint-4, resumed on 2
    ranks (batch 4 each) through the universal checkpoint, ends where the 2-rank run does."""
    ref = runs(strategy)
    out = tmp_path / "grow"
    args = [*COMMON, *SAVES]
    one = list(args)
    one[one.index("--batch") + 1] = "8"
    run_ok(1, out, "--strategy", strategy, *one, "--stop", "4")
    p = run_ok(2, out, "--strategy", strategy, *args, "--resume")
    assert "converting it to DeepSpeed's universal checkpoint format" in p.stderr
    assert_close(weights(out), weights(ref), tol=TOL)


def test_a_checkpoint_of_another_layout_is_refused_by_name(runs, tmp_path):
    """A DeepSpeed checkpoint resumed under single/DDP failed on a bare FileNotFoundError
    (model.safetensors), under FSDP with a message calling it a full-state checkpoint; a
    single/DDP checkpoint resumed under DeepSpeed dropped the Adam moments with a warning only
    (FSDP refuses that move). Each one error naming who wrote it and what to do instead."""
    out = copied_checkpoint(runs("deepspeed_zero2"), tmp_path / "z2")
    for strategy in ("single", "fsdp"):
        p = launch(1, out, "--strategy", strategy, *COMMON, *SAVES, "--resume")
        assert p.returncode != 0
        assert "was written by a DeepSpeed ZeRO strategy, and the " + strategy in p.stderr, p.stderr[-3000:]
        assert "`lightlike export" in p.stderr and "FileNotFoundError" not in p.stderr, p.stderr[-3000:]
    out = copied_checkpoint(runs("ddp"), tmp_path / "ddp")
    p = launch(1, out, "--strategy", "deepspeed_zero2", *COMMON, *SAVES, "--resume")
    assert p.returncode != 0
    assert "was written by a strategy that gathers the full state" in p.stderr, p.stderr[-3000:]
    assert "module.load_weights(path) before fit()" in p.stderr, p.stderr[-3000:]


def test_a_nan_gradient_on_one_rank_is_skipped_or_raised_on_every_rank(tmp_path):
    """DeepSpeed's engine computes the norm in engine.step() and skips a step whose norm is not
    finite (reported as inf): 'skip' counts it as the loop's own skip on both ranks; 'raise' raised
    nothing (the step was counted as an fp16 overflow and the fit succeeded): both ranks now
    raise naming step 3, before checkpoint-3."""
    check_nan_gradient(tmp_path, "deepspeed_zero2")


def test_settings_that_let_a_nan_gradient_through_are_refused():
    """compute_grad_norm=false (ZeRO-1/2: no norm, no check in fp32) and bf16.check_grad_overflow=false
    let DeepSpeed step with a NaN gradient: refused by name."""
    from lightlike.strategies.deepspeed import DeepSpeedStrategy

    for bad in ({"zero_optimization": {"stage": 2, "compute_grad_norm": False}},
                {"bf16": {"check_grad_overflow": False}}):
        key = ".".join(next((k, next(iter(v.keys() - {"stage"}))) for k, v in bad.items()))
        with pytest.raises(ConfigError, match=f"{key}=false in the DeepSpeed config"):
            DeepSpeedStrategy(stage=2, config=bad).build_config(FIT, 2)

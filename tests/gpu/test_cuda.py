"""The CUDA paths, on a GPU: ``LIGHTLIKE_TEST_GPU=1 pytest tests/gpu/test_cuda.py`` (skipped where there
is none, and without that variable, which tests/conftest.py reads; CI has no GPU; a session lent
one runs ``bash benchmarks/gpu_session.sh``).

Each precision on one GPU against a hand-written CUDA loop (torch's AMP recipe for ``16-mixed``);
a real fp16 overflow skipped and counted; DDP with nccl (one process under torchrun), FSDP2 and
DeepSpeed's ZeRO 2 and 3 (where DeepSpeed is installed) against one device; and a resume on the GPU, CUDA's random state included (dropout), reaching
the uninterrupted run's weights bit for bit under single, DDP and FSDP, and with a user's
DataLoader (the bug the first GPU run found: benchmarks/RESULTS.md, 2026-11-27).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset, Dropout, StopAt, flat_params, run_killing_group, stacked_batches
from launching import DDP_TARGET, free_port, weights

import lightlike as ll
from lightlike.precision import MixedPrecision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device, left visible by LIGHTLIKE_TEST_GPU=1")

CUDA = torch.device("cuda")
#: the device image lends no DeepSpeed: benchmarks/gpu_wheels.sh makes the wheels a session carries
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
ZERO = Path(__file__).parents[1] / "scripts" / "zero_target.py"  # ddp_target.py for the DeepSpeed strategies


def _hand_written(model, precision, steps, bs, lr, max_norm):
    """The loop a user writes for each precision on CUDA: autocast for the mixed ones (and
    torch's GradScaler recipe for fp16), parameters and float inputs cast for the true ones."""
    model.to(CUDA)
    half = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)
    if half is not None:
        model.to(half)
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in stacked_batches(steps * bs, bs):  # test_precision_reference's, moved to the GPU
        batch = {k: v.to(CUDA) for k, v in batch.items()}
        if half is not None:
            batch["x"] = batch["x"].to(half)
        with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = model.loss(model(batch), batch)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return scaler


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
def test_each_precision_on_one_gpu_matches_a_hand_written_cuda_loop(tmp_path, precision, record_property):
    torch.manual_seed(0)
    model = Classifier()
    ref = copy.deepcopy(model)
    fitter = ll.Fitter(precision=precision, accelerator="cuda", max_steps=4, batch_size=8, shuffle=False,
                       optimizer="sgd", learning_rate=0.1, lr_scheduler="constant", max_grad_norm=0.5,
                       output_dir=str(tmp_path), loggers=[], model_summary=False, save_strategy="no")
    result = fitter.fit(model, DictDataset(n=32))
    scaler = _hand_written(ref, precision, 4, 8, 0.1, 0.5)
    diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    record_property("max_abs_diff", diff)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.device.type == "cuda" and p.dtype == q.dtype, name
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=name)
    assert result.skipped_steps == 0 and result.peak_memory_bytes > 0
    if scaler is not None:
        assert fitter.strategy.precision.state_dict()["scaler"] == scaler.state_dict()


def test_an_fp16_overflow_on_the_gpu_skips_the_step_counts_it_and_holds_the_schedule(tmp_path):
    """A loss scale of 2**40 overflows fp16's backward (inf gradients) at every step: each step is
    skipped and counted, the weights stay as they were, the scale halves as torch's GradScaler
    halves it, and the learning-rate schedule does not advance; the fit, which trained nothing,
    raises at its end."""
    torch.manual_seed(0)
    model = Classifier()
    before = [p.detach().clone() for p in model.parameters()]
    precision = MixedPrecision("16", init_scale=2.0**40)
    fitter = ll.Fitter(precision=precision, accelerator="cuda", max_steps=3, batch_size=8, shuffle=False,
                       optimizer="sgd", learning_rate=0.1, output_dir=str(tmp_path), loggers=[],
                       model_summary=False, save_strategy="no")
    with pytest.raises(ll.AllStepsSkippedError, match=r"\(loss-scale overflow: 3\)"):  # nothing was trained
        fitter.fit(model, DictDataset(n=24))
    assert fitter.state.skipped_steps == 3 and fitter.state.global_step == 3
    assert all(torch.equal(p.detach().cpu(), b) for p, b in zip(model.parameters(), before, strict=True))
    assert precision.scaler.get_scale() == 2.0**37
    assert fitter.scheduler.last_epoch == 0 and fitter.optimizer.param_groups[0]["lr"] == 0.1


def _run(nproc, out, *args, script=DDP_TARGET):
    """ddp_target.py (or ``script``) as one plain process (``nproc`` 0) or under torchrun with ``nproc``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(script), str(out), "--dtype", "float32", *args]
    if nproc:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                    "--master_port", str(free_port())]
    try:  # a rank that hangs prints its threads' stacks (faulthandler) before it is killed
        p = run_killing_group(cmd, timeout=120, env={**os.environ, "LIGHTLIKE_DUMP_AFTER": "100"})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung:\n{(e.stderr or '')[-6000:]}")
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _where(out: Path) -> dict:
    return json.loads((out / "where-rank0.json").read_text())


@pytest.mark.parametrize("strategy,precision", [
    ("ddp", "32-true"), ("ddp", "bf16-mixed"), ("ddp", "16-mixed"), ("fsdp", "32-true"),
    pytest.param("deepspeed_zero2", "32-true", marks=needs_deepspeed),
    pytest.param("deepspeed_zero3", "32-true", marks=needs_deepspeed)])
def test_ddp_with_nccl_and_fsdp_on_one_gpu_match_one_device(tmp_path, strategy, precision, record_property):
    """One process under torchrun: nccl, the same weights as the single-device run (accumulation
    over uneven item counts, norm clipping, a short last batch); DeepSpeed's ZeRO too, where the
    image has it."""
    args = ["--task", "token", "--accum", "2", "--steps", "6", "--items", "46", "--batch", "4",
            "--max-grad-norm", "0.5", "--precision", precision]
    _run(0, tmp_path / "single", *args)
    _run(1, tmp_path / strategy, "--strategy", strategy, *args,
         script=ZERO if strategy.startswith("deepspeed") else DDP_TARGET)
    assert _where(tmp_path / "single") == {"device": "cuda:0", "backend": None}
    assert _where(tmp_path / strategy) == {"device": "cuda:0", "backend": "nccl"}
    one, got = weights(tmp_path / "single"), weights(tmp_path / strategy)
    diff = max((one[k] - got[k]).abs().max().item() for k in one)
    record_property("max_abs_diff", diff)
    for k in one:
        torch.testing.assert_close(got[k], one[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("nproc,strategy,precision", [
    (0, "auto", "bf16-mixed"), (0, "auto", "16-mixed"), (1, "ddp", "bf16-mixed"), (1, "fsdp", "bf16-mixed"),
    pytest.param(1, "deepspeed_zero2", "bf16-mixed", marks=needs_deepspeed),
    pytest.param(1, "deepspeed_zero2", "16-true", marks=needs_deepspeed)])  # DeepSpeed's fp16 mode
def test_resume_on_the_gpu_reaches_the_uninterrupted_weights_bit_for_bit(tmp_path, nproc, strategy, precision,
                                                                         record_property):
    """Stopped after step 5 (checkpoint at 4), resumed to step 8: the weights equal the run that
    went through, bit for bit. Dropout draws from CUDA's generator: its state is in the checkpoint."""
    args = ["--task", "dropout", "--steps", "8", "--items", "64", "--batch", "4", "--save-every", "4",
            "--strategy", strategy, "--precision", precision]
    script = ZERO if strategy.startswith("deepspeed") else DDP_TARGET
    _run(nproc, tmp_path / "through", *args, script=script)
    _run(nproc, tmp_path / "resumed", *args, "--stop", "5", script=script)
    _run(nproc, tmp_path / "resumed", *args, "--resume", script=script)
    assert _where(tmp_path / "resumed")["device"] == "cuda:0"
    a, b = weights(tmp_path / "through"), weights(tmp_path / "resumed")
    record_property("max_abs_diff", max((a[k] - b[k]).abs().max().item() for k in a))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ"
    rng = torch.load(tmp_path / "through" / "checkpoint-4" / "rng.pt", weights_only=True)[0]
    assert "cuda" in rng, "the checkpoint holds no CUDA random state"


@pytest.mark.parametrize("user_loader", [False, True])
def test_dropout_on_the_gpu_resumes_bit_for_bit_with_lightlikes_sampler_and_a_users_loader(tmp_path, user_loader):
    """In one process (the module and the data as tests/checkpoint/test_resume.py's): stopped after step 5,
    resumed from checkpoint-3 (mid-epoch) to step 12. With a user's DataLoader without
    generator= this diverged on the GPU: lightlike reseeded CUDA's generator at every epoch start
    while drawing the loader's base seed (the bug test_data.py pins on the CPU)."""

    from lightlike.data import LengthGroupedSampler

    def data():
        items = DictDataset(n=32)
        if not user_loader:
            return items
        return torch.utils.data.DataLoader(items, batch_size=4, sampler=LengthGroupedSampler([1] * 32, 4, seed=0))

    def go(out, stop=None, resume=None):
        torch.manual_seed(0)
        model = Dropout()
        fitter = ll.Fitter(max_steps=12, batch_size=4, save_every=3, accelerator="cuda", output_dir=str(out),
                           loggers=[], model_summary=False, callbacks=[StopAt(stop)] if stop else [])
        with contextlib.suppress(KeyboardInterrupt):
            fitter.fit(model, data(), resume=resume)
        return flat_params(model)

    reference = go(tmp_path / "ref")
    go(tmp_path / "cut", stop=5)
    resumed = go(tmp_path / "cut", resume=True)
    assert reference.device.type == "cuda" and torch.equal(resumed, reference)

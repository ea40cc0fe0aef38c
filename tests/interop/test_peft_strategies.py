"""A LoRA fine-tune (tests/scripts/peft_target.py: a tiny float64 Llama, its q/v projections
adapted) on two processes under DDP and under FSDP (gloo), against the same fine-tune on one
process with the same global batch: the same weights (float64 rounding apart); checkpoints that
hold the adapter alone (DDP's model.safetensors, FSDP's DCP shards) with the base's fingerprint;
a run stopped after step 3 and resumed ends bit for bit as the uninterrupted one, weights and
optimizer state; the exported adapter folder loads with ``PeftModel.from_pretrained``."""

from __future__ import annotations

import json

import pytest
import torch
from launching import SCRIPTS, launch, run_each_ok
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SCRIPT = SCRIPTS / "peft_target.py"
STRATEGIES = ["ddp", "fsdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: folder}: for each strategy its uninterrupted 2-process run and the one stopped and
    resumed (one launch of two processes, ``--then``); and the one-process run (batch 8)."""
    base = tmp_path_factory.mktemp("peft-strategies")
    todo, out = [], {}
    for strategy in STRATEGIES:
        ref, cut = base / f"{strategy}-ref", base / f"{strategy}-cut"
        todo += [(ref, ["--strategy", strategy, "--export"]), (cut, ["--strategy", strategy, "--stop", "3"]),
                 (cut, ["--strategy", strategy, "--resume", "--export"])]
        out[strategy], out[f"{strategy}-cut"] = ref, cut
    run_each_ok(2, todo, script=SCRIPT)
    one = base / "one"
    p = launch(1, one, "--batch", "8", "--export", script=SCRIPT)
    assert p.returncode == 0, p.stderr[-4000:]
    out["one"] = one
    return out


def final(folder, rank=0):
    return torch.load(folder / f"final-rank{rank}.pt", weights_only=True)


def scripts():
    import sys

    sys.path.insert(0, str(SCRIPTS))
    import peft_target

    return peft_target


def module_with(weights):
    module = scripts().build_module()
    module.load_state_dict(weights)
    return module.eval()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_train_the_adapter_as_one_does(runs, strategy):
    one = final(runs["one"])
    for rank in (0, 1):
        got = final(runs[strategy], rank)
        assert got.keys() == one.keys()
        for k in one:
            torch.testing.assert_close(got[k], one[k], rtol=0, atol=1e-12, msg=k)
            if "lora" not in k:  # the frozen base: not moved at all
                assert torch.equal(got[k], one[k]), k
    start = scripts().build_module().state_dict()  # and the adapter did train
    assert all(not torch.equal(one[k], start[k]) for k in one if "lora_B" in k)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoints_hold_the_adapter_and_the_fingerprint(runs, strategy):
    ckpt = runs[strategy] / "checkpoint-6"
    adapter = {k for k in final(runs["one"]) if "lora_" in k}
    assert len(adapter) == 8
    if strategy == "ddp":
        assert set(load_file(str(ckpt / "model.safetensors"))) == adapter
    else:
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(ckpt / "dcp").read_metadata().state_dict_metadata
        assert {k[len("model."):] for k in meta if k.startswith("model.")} == adapter
        assert not (ckpt / "model.safetensors").exists()
    record = json.loads((ckpt / "base_fingerprint.json").read_text())
    one = json.loads((runs["one"] / "checkpoint-6" / "base_fingerprint.json").read_text())
    assert record == one  # taken before sharding: the same base on every strategy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stopped_and_resumed_ends_bit_for_bit(runs, strategy):
    ref, cut = runs[strategy], runs[f"{strategy}-cut"]
    assert (cut / "checkpoint-3").is_dir()
    for rank in (0, 1):
        a, b = final(ref, rank), final(cut, rank)
        assert all(torch.equal(a[k], b[k]) for k in a), rank
    a = torch.load(ref / "optim-rank0.pt", weights_only=True)
    b = torch.load(cut / "optim-rank0.pt", weights_only=True)
    assert len(a) == 8 and a.keys() == b.keys()
    assert all(torch.equal(a[k][s], b[k][s]) for k in a for s in a[k])


@pytest.mark.parametrize("strategy", [*STRATEGIES, "fsdp-cut"])
def test_the_exported_adapter_loads_with_peft_and_gives_the_trained_logits(runs, strategy):
    folder = runs[strategy]
    trained = module_with(final(folder))
    loaded = peft.PeftModel.from_pretrained(scripts().build_base(), folder / "adapter").eval()
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained.model(input_ids=ids).logits)

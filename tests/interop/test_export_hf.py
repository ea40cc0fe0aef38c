"""``export_hf`` of a checkpoint, beyond the round trip in test_interop.py: the weights keep the
checkpoint's dtype (a bf16 run exports bf16, not the float32 a model built from its config has),
and tied weights that differ in the checkpoint are refused rather than one of them dropped; a
module sharded by FSDP is refused, naming the export of its checkpoint, which consolidates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_interop import QUIET, TokenData, tiny_gpt2

import lightlike as ll

transformers = pytest.importorskip("transformers")
from lightlike.interop.hf import HFCausalLM, export_hf  # noqa: E402


def one_step_checkpoint(tmp_path, model):
    """Train ``model`` one step (learning rate high enough to move every weight) and return its
    checkpoint-1 and its module."""
    module = HFCausalLM(model)
    fitter = ll.Fitter(max_steps=1, batch_size=4, learning_rate=1e-2, save_every=1, output_dir=str(tmp_path / "run"),
                       seed=0, **QUIET)
    fitter.fit(module, TokenData(8))
    return tmp_path / "run" / "checkpoint-1", module


def test_export_hf_of_a_bf16_checkpoint_writes_bf16(tmp_path):
    ckpt, module = one_step_checkpoint(tmp_path, tiny_gpt2(torch.bfloat16))
    saved = load_file(str(ckpt / "model.safetensors"))
    assert {v.dtype for v in saved.values() if v.is_floating_point()} == {torch.bfloat16}

    out = export_hf(ckpt, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert {v.dtype for v in exported.values() if v.is_floating_point()} == {torch.bfloat16}
    for k, v in exported.items():  # the same bits as the checkpoint's (no round trip through float32 lost)
        assert torch.equal(v, saved[f"model.{k}"]), k
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="auto")
    assert loaded.dtype == torch.bfloat16
    trained = module.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def test_export_hf_refuses_tied_weights_that_differ(tmp_path):
    """A model trained untied (its lm_head moved away from the embedding) exported with a config
    that ties them: loading would keep only one of the two, so it is an error naming them."""
    model = tiny_gpt2()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    ckpt, module = one_step_checkpoint(tmp_path, model)
    saved = load_file(str(ckpt / "model.safetensors"))
    assert not torch.equal(saved["model.lm_head.weight"], saved["model.transformer.wte.weight"])
    hf_config = json.loads((ckpt / "hparams.json").read_text())["hf_config"]
    assert hf_config["tie_word_embeddings"] is False

    differ = r"\['(transformer\.wte|lm_head)\.weight'.*\] are tied in the model \(gpt2\) but differ"
    with pytest.raises(ll.CheckpointError, match=differ):
        export_hf(ckpt, tmp_path / "tied", config={**hf_config, "tie_word_embeddings": True})
    assert not (tmp_path / "tied" / "model.safetensors").exists()
    as_object = transformers.AutoConfig.for_model(**{**hf_config, "tie_word_embeddings": True})
    with pytest.raises(ll.CheckpointError, match=differ):  # a PretrainedConfig is used as given, too
        export_hf(ckpt, tmp_path / "tied", config=as_object)
    untyped = {k: v for k, v in hf_config.items() if k != "model_type"}
    with pytest.raises(ll.CheckpointError, match="the Hugging Face config for .* has no model_type"):
        export_hf(ckpt, tmp_path / "tied", config=untyped)
    with pytest.raises(ll.CheckpointError, match=r"has no weights under 'nope\.' .*e\.g\. prefix=''"):
        export_hf(ckpt, tmp_path / "tied", prefix="nope.")

    out = export_hf(ckpt, tmp_path / "untied")  # its own config: untied, both kept
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is not loaded.transformer.wte.weight
    assert torch.equal(loaded.lm_head.weight, module.model.lm_head.weight)
    assert torch.equal(loaded.transformer.wte.weight, module.model.transformer.wte.weight)


def test_export_hf_of_a_sharded_module_says_to_export_its_checkpoint(tmp_path):
    """After an FSDP fit the module's parameters are DTensor shards: save_pretrained waited in a
    collective (called on rank 0), failed on a storage error (on every rank) or, under ZeRO-3,
    wrote empty tensors. One error pointing at the checkpoint export, which consolidates; that
    export loads with from_pretrained. ``batch_keys`` tells remove_unused_keys what the module
    reads. The same for an ``HFModel`` (a BERT sequence classifier): its sharded checkpoint exports
    to a folder ``AutoModelForSequenceClassification`` loads, with the trained weights. (In a
    subprocess: the FSDP fit leaves its process group for the sharded module.)"""
    pytest.importorskip("transformers")
    code = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
import pytest, torch, transformers
import lightlike as ll
from lightlike.data.keys import remove_unused_keys
from lightlike.errors import ModuleContractError
from lightlike.interop.hf import HFCausalLM, HFModel, export_hf
from test_interop import QUIET, TokenData, bert_items, tiny_gpt2
out = {str(tmp_path)!r}
module = HFCausalLM(tiny_gpt2())
ll.Fitter(strategy="fsdp", max_steps=2, batch_size=8, save_every=2, output_dir=out + "/run", seed=0,
          **QUIET).fit(module, TokenData(16))
with pytest.raises(ModuleContractError, match=r"sharded across processes .* export_hf\\('OUTPUT_DIR/checkpoint-N'"):
    export_hf(module, out + "/from_module")
path = export_hf(out + "/run/checkpoint-2", out + "/from_checkpoint")
assert transformers.AutoModelForCausalLM.from_pretrained(path).transformer.wte.weight.shape == (100, 32)
collate = remove_unused_keys(module, lambda items: {{**items[0], "idx": 1, "text": "x"}})
assert sorted(collate([TokenData(1)[0]])) == ["attention_mask", "input_ids", "labels"]
bert = HFModel(transformers.BertForSequenceClassification(transformers.BertConfig(vocab_size=30, hidden_size=16,
    num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, max_position_embeddings=32, num_labels=3)))
ll.Fitter(strategy="fsdp", max_steps=2, batch_size=4, save_every=2, output_dir=out + "/bert", seed=0,
          **QUIET).fit(bert, bert_items(8))
with pytest.raises(ModuleContractError, match=r"sharded across processes"):
    export_hf(bert, out + "/bert_module")
loaded = transformers.AutoModelForSequenceClassification.from_pretrained(export_hf(out + "/bert/checkpoint-2",
                                                                                  out + "/bert_hf"))
trained = {{k: v.full_tensor() for k, v in bert.model.state_dict().items()}}
assert type(loaded).__name__ == "BertForSequenceClassification"
assert loaded.state_dict().keys() == trained.keys()
assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
print("OK")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]

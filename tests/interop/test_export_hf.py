"""``export_hf`` of a checkpoint, beyond the round trip in test_interop.py: the weights keep the
checkpoint's dtype (a bf16 run exports bf16, not the float32 a model built from its config has),
and tied weights that differ in the checkpoint are refused rather than one of them dropped."""

from __future__ import annotations

import json

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

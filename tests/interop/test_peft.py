"""PEFT adapters through ``HFCausalLM``: a checkpoint holds the adapter (what trains) and the
fingerprint of the frozen base; an interrupted fit resumes bit for bit; a resume onto another
base is refused; ``export_hf`` and ``lightlike export`` write the adapter folder that
``PeftModel.from_pretrained`` loads (logits equal to the trained module's) or, with
``merge=True``, the merged model ``AutoModelForCausalLM.from_pretrained`` loads. The references
are the libraries themselves: peft and transformers reading back what was written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lightlike as ll

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from lightlike.interop.hf import HFCausalLM, export_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUIET = {"loggers": [], "log_level": "warning", "model_summary": False, "progress_bar": False}
TARGETS = ["q_proj", "v_proj"]


def tiny_base(seed=0, dtype=torch.float32):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def lora_module(base=None, **kw):
    config = peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0, **kw)
    torch.manual_seed(1)
    return HFCausalLM(peft.get_peft_model(base if base is not None else tiny_base(), config))


def token_data(n=32, length=12):
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 64, (length,), generator=g)} for _ in range(n)]


class StopAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True


def fit(module, out, steps=6, resume=None, callbacks=(), **kw):
    settings = dict(max_steps=steps, batch_size=4, learning_rate=1e-2, save_every=2, output_dir=str(out), seed=0)
    fitter = ll.Fitter(**{**settings, **kw}, callbacks=list(callbacks), **QUIET)
    fitter.fit(module, token_data(), resume=resume)
    return fitter


def adapter_keys(module):
    return {n for n, p in module.named_parameters() if p.requires_grad}


def test_a_checkpoint_holds_the_adapter_and_the_fingerprint_of_the_base(tmp_path):
    module = lora_module()
    base_before = {k: v.clone() for k, v in module.model.get_base_model().state_dict().items() if "lora" not in k}
    fit(module, tmp_path / "run", steps=2)
    ckpt = tmp_path / "run" / "checkpoint-2"
    saved = load_file(str(ckpt / "model.safetensors"))
    assert set(saved) == adapter_keys(module) and len(saved) == 8  # 2 layers x q, v x A, B; no base weight
    assert all(torch.equal(saved[k], module.state_dict()[k]) for k in saved)
    record = json.loads((ckpt / "base_fingerprint.json").read_text())
    assert record["algorithm"] == "xxh3_128" and len(record["fingerprint"]) == 32
    assert record["trained_keys"] == 8 and record["frozen_keys"] == len(module.state_dict()) - 8
    hparams = json.loads((ckpt / "hparams.json").read_text())
    assert hparams["hf_class"] == "LlamaForCausalLM" and hparams["peft_config"]["r"] == 4
    assert sorted(hparams["peft_config"]["target_modules"]) == TARGETS
    # the base did not train (bit for bit), the adapter did
    now = module.model.get_base_model().state_dict()
    assert all(torch.equal(now[k], v) for k, v in base_before.items())
    whole = fit(HFCausalLM(tiny_base()), tmp_path / "whole", steps=2)  # the same model trained whole, for the size
    assert whole.state.global_step == 2
    full = load_file(str(tmp_path / "whole" / "checkpoint-2" / "model.safetensors"))
    assert len(full) == len(HFCausalLM(tiny_base()).state_dict())
    assert not (tmp_path / "whole" / "checkpoint-2" / "base_fingerprint.json").exists()


def test_the_fingerprint_is_of_the_base_weights_bit_for_bit():
    from lightlike.checkpoint.frozen import BaseFingerprint

    a, b = BaseFingerprint.of(lora_module()), BaseFingerprint.of(lora_module())
    assert a.value == b.value  # the same base (the adapter's initial values are not in it)
    changed = tiny_base()
    w = changed.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():  # one bit of one frozen weight
        w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(1.0))
    assert BaseFingerprint.of(lora_module(changed)).value != a.value
    assert BaseFingerprint.of(HFCausalLM(tiny_base())).state_dict() is None  # trains everything: no record


def test_an_interrupted_lora_fit_resumes_bit_for_bit(tmp_path):
    """Stopped after step 3 (checkpoint-2 is the newest), resumed: the adapter, the frozen base
    and the optimizer state equal the uninterrupted run's, torch.equal."""
    ref = lora_module()
    ref_fitter = fit(ref, tmp_path / "ref")
    cut = lora_module()
    fit(cut, tmp_path / "cut", callbacks=[StopAt(3)])
    resumed = lora_module()
    fitter = fit(resumed, tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-2"))
    assert fitter.state.global_step == 6
    want, got = ref.state_dict(), resumed.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    a, b = ref_fitter.optimizer.state_dict()["state"], fitter.optimizer.state_dict()["state"]
    assert len(a) == 8 and a.keys() == b.keys()
    for i in a:
        assert all(torch.equal(a[i][n], b[i][n]) for n in a[i]), i
    # and module.load_weights of an adapter checkpoint sets the adapter (the base is the module's own)
    fresh = lora_module()
    fresh.load_weights(tmp_path / "ref" / "checkpoint-6")
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
    with pytest.raises(ll.CheckpointError, match="another base model"):  # ... and is refused on another base
        lora_module(tiny_base(seed=7)).load_weights(tmp_path / "ref" / "checkpoint-6")


def test_a_resume_onto_another_base_is_refused_naming_both_fingerprints(tmp_path):
    fit(lora_module(), tmp_path / "run", steps=2)
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / "base_fingerprint.json").read_text())["fingerprint"]
    other = lora_module(tiny_base(seed=7))
    with pytest.raises(ll.CheckpointError, match=rf"another base model.*{saved}.*this module's [0-9a-f]{{32}}"):
        fit(other, tmp_path / "run", steps=4, resume=True)
    plain = HFCausalLM(tiny_base())  # the same base, trained whole: the checkpoint lacks its weights
    with pytest.raises(ll.CheckpointError, match="holds only the trained part of a module"):
        fit(plain, tmp_path / "run", steps=4, resume=True)


def test_a_peft_model_that_trains_nothing_is_refused_at_set_up(tmp_path):
    module = lora_module(inference_mode=True)
    assert not any(p.requires_grad for p in module.parameters())
    with pytest.raises(ll.ConfigError, match="trains nothing: every parameter has requires_grad=False"):
        fit(module, tmp_path / "run", steps=1)
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(3))


def test_export_of_a_checkpoint_is_the_adapter_folder_peft_loads(tmp_path):
    module = lora_module()
    fit(module, tmp_path / "run", steps=4)
    want = logits(module.model, IDS)
    out = export_hf(tmp_path / "run" / "checkpoint-4", tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(out))
    loaded = peft.PeftModel.from_pretrained(tiny_base(), out)
    assert torch.equal(logits(loaded, IDS), want)
    # the module itself exports the same folder
    from_module = export_hf(module, tmp_path / "adapter-of-module")
    a, b = load_file(str(out / "adapter_model.safetensors")), load_file(str(from_module / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the command line: `lightlike export` of a PEFT checkpoint writes the adapter folder
    p = subprocess.run([sys.executable, "-m", "lightlike", "export", str(tmp_path / "run" / "checkpoint-4"),
                        str(tmp_path / "cli")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert torch.equal(logits(peft.PeftModel.from_pretrained(tiny_base(), tmp_path / "cli"), IDS), want)


def test_merged_export_needs_the_base_and_loads_with_from_pretrained(tmp_path):
    module = lora_module()
    fit(module, tmp_path / "run", steps=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    want = logits(module.model, IDS)
    with pytest.raises(ll.CheckpointError, match="holds a PEFT adapter only.*pass base="):
        export_hf(ckpt, tmp_path / "merged", merge=True)
    with pytest.raises(ll.CheckpointError, match="another base model"):  # the base is checked
        export_hf(ckpt, tmp_path / "merged", merge=True, base=tiny_base(seed=7))
    base = tiny_base()
    base_before = {k: v.clone() for k, v in base.state_dict().items()}
    out = export_hf(ckpt, tmp_path / "merged", merge=True, base=base)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in base_before.items())  # the base given is untouched
    merged = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged, IDS), want, rtol=0, atol=1e-5)
    # a base folder works as well (read with from_pretrained), on the command line too
    tiny_base().save_pretrained(tmp_path / "base")
    from_module = export_hf(module, tmp_path / "merged-of-module", merge=True)
    torch.testing.assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(from_module), IDS), want,
                               rtol=0, atol=1e-5)
    assert any("lora" in k for k in module.state_dict())  # the module keeps its adapter
    p = subprocess.run([sys.executable, "-m", "lightlike", "export", str(ckpt), str(tmp_path / "cli"), "--merge",
                        "--base", str(tmp_path / "base")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    torch.testing.assert_close(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cli"), IDS),
                               want, rtol=0, atol=1e-5)


def test_save_only_model_and_load_best_at_end_load_the_adapter_into_the_base(tmp_path):
    """Weights-only checkpoints hold the adapter; the best one's adapter is loaded back at the
    end (the base, not in it, stays as it is)."""
    module = lora_module()
    val = token_data(8)
    fitter = ll.Fitter(max_steps=6, batch_size=4, learning_rate=5e-2, save_every=2, eval_every=2,
                       save_only_model=True, load_best_at_end=True, metric_for_best="val/loss",
                       greater_is_better=False, output_dir=str(tmp_path / "run"), seed=0, **QUIET)
    fitter.fit(module, token_data(), val)
    best = Path(fitter.state.best_checkpoint)
    saved = load_file(str(best / "model.safetensors"))
    assert set(saved) == adapter_keys(module)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in saved.items())
    if best.name != "checkpoint-6":  # the final weights were replaced by the best ones
        last = load_file(str(tmp_path / "run" / "checkpoint-6" / "model.safetensors"))
        assert any(not torch.equal(last[k], saved[k]) for k in saved)


def test_the_lora_example_runs_and_exports_an_adapter_peft_loads(tmp_path):
    """examples/hf_lora.py, shortened: the loss on the text goes down, the checkpoint holds the
    adapter alone, and the exported adapter loaded by peft gives the trained module's logits."""
    out = tmp_path / "lora"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_lora.py"), "--max-steps", "12", "--output-dir",
                        str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    before, after = map(float, re.search(r"loss on the text: ([\d.]+) before, ([\d.]+) after", p.stdout).groups())
    assert after < before
    assert "PeftModel.from_pretrained gives the trained logits: True" in p.stdout
    saved = load_file(str(out / "checkpoint-12" / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "merged" / "model.safetensors").is_file()


def test_merge_of_a_model_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(ll.ConfigError, match=r"merge=True\) merges a PEFT adapter.*drop merge=True"):
        export_hf(HFCausalLM(tiny_base()), tmp_path / "out", merge=True)
    assert not (tmp_path / "out").exists()
    fit(HFCausalLM(tiny_base()), tmp_path / "run", steps=2)
    with pytest.raises(ll.ConfigError, match="holds a whole model, not a PEFT adapter"):
        export_hf(tmp_path / "run" / "checkpoint-2", tmp_path / "out", merge=True)
    p = subprocess.run([sys.executable, "-m", "lightlike", "export", str(tmp_path / "run" / "checkpoint-2"),
                        str(tmp_path / "cli"), "--merge"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "--merge and --base are for a PEFT adapter's checkpoint" in p.stderr

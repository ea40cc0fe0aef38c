"""export_hf of a run's output_dir (docs/migrating.md's ``export_hf("runs/bert", "bert-finetuned")``):
the newest valid checkpoint, read back by transformers; a failed export leaves no folder behind."""

from __future__ import annotations

import pytest
import torch

import lightlike as ll

transformers = pytest.importorskip("transformers")
from lightlike.interop.hf import HFCausalLM, export_hf  # noqa: E402

QUIET = {"loggers": [], "log_level": "warning", "model_summary": False, "progress_bar": False}


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = (torch.arange(8) * (i % 3 + 1) + i) % 50
        return {"input_ids": ids, "labels": ids}


def test_export_hf_of_a_run_folder_takes_its_newest_valid_checkpoint(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    torch.manual_seed(0)
    module = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))
    run = tmp_path / "run"
    ll.Fitter(max_steps=2, batch_size=4, learning_rate=1e-2, save_every=1, output_dir=str(run), **QUIET).fit(
        module, Tokens())
    (run / "checkpoint-2" / "manifest.json").write_text("{")  # torn: checkpoint-1 is the newest valid
    out = export_hf(run, tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    saved = ll.checkpoint.weights.load_safetensors(run / "checkpoint-1" / "model.safetensors")
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in loaded.items() if f"model.{k}" in saved)
    assert not torch.equal(loaded["transformer.wte.weight"], module.model.state_dict()["transformer.wte.weight"])


def test_a_failed_export_hf_leaves_no_folder(tmp_path):
    """A checkpoint of a module that is no Hugging Face model: refused, and the folder it would
    have written (and its new parent) is not left behind empty."""
    from helpers import Classifier, DictDataset

    run = tmp_path / "run"
    ll.Fitter(max_steps=1, batch_size=4, save_every=1, output_dir=str(run), **QUIET).fit(Classifier(), DictDataset(8))
    with pytest.raises(ll.CheckpointError, match="records no Hugging Face config"):
        export_hf(run, tmp_path / "new" / "bert-finetuned")
    assert not (tmp_path / "new").exists()
    with pytest.raises(ll.CheckpointError, match="no such checkpoint directory"):
        export_hf(tmp_path / "missing", tmp_path / "new2")
    assert not (tmp_path / "new2").exists()

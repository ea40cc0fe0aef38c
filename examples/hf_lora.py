"""Fine-tune a Hugging Face causal LM with a LoRA adapter (PEFT), then export the adapter.

The base model is a small Llama built from a config and saved as a model folder, standing for
the pretrained model you would download (nothing is downloaded here); its weights stay frozen.
A LoRA adapter on the attention projections learns local text, byte by byte (token = byte
value, no tokenizer needed): a text file you name, or the paragraph below. The checkpoints hold
the adapter alone, with a fingerprint of the base it was trained on (a resume onto another base
is refused); the final checkpoint is exported as the adapter folder that
``PeftModel.from_pretrained(base, folder)`` loads, and as a merged model.

    pip install 'lightlike[hf]'
    python examples/hf_lora.py                   # a few seconds on a CPU
    python examples/hf_lora.py --text notes.txt --max-steps 300
    python examples/hf_lora.py --resume          # after a kill: continue from the newest checkpoint
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

import lightlike as ll
from lightlike.interop.hf import HFCausalLM, export_hf

TEXT = """\
Lightlike trains PyTorch models with an explicit loop. A module says how to compute its outputs,
its loss and its metrics; the fitter runs the steps, evaluates, saves checkpoints that resume bit
for bit, and writes logs. A LoRA adapter trains two small matrices beside each frozen projection:
the checkpoint keeps those and a fingerprint of the base model, so it stays small.
"""
BOS = 1  # byte value 1 never occurs in text: the start of every window


class ByteWindows(Dataset):
    """Overlapping windows of ``length`` bytes of ``text`` (``BOS`` first), as ``input_ids``."""

    def __init__(self, text: bytes, length: int, stride: int):
        self.windows = [torch.tensor([BOS, *text[i:i + length - 1]])
                        for i in range(0, max(1, len(text) - length + 2), stride)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i]}


def base_model_folder(folder: Path) -> Path:
    """A small Llama saved as a model folder: the 'pretrained' base (the same every run)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (folder / "config.json").is_file():
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                             bos_token_id=BOS, eos_token_id=BOS, pad_token_id=0)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", type=Path, help="a text file to learn (default: a paragraph in this script)")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=8, help="the LoRA rank")
    p.add_argument("--output-dir", default="runs/hf_lora")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --output-dir")
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    text = args.text.read_bytes() if args.text else TEXT.encode()

    fitter = ll.Fitter(max_steps=args.max_steps, batch_size=8, learning_rate=1e-2, warmup_ratio=0.1,
                       eval_every=max(1, args.max_steps // 3), save_every=max(1, args.max_steps // 3),
                       save_total_limit=2, output_dir=str(out), overwrite_output_dir=args.overwrite, seed=0,
                       log_every=max(1, args.max_steps // 6))
    base_dir = base_model_folder(Path(str(out) + "-base"))
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      lora_dropout=0.0)
    module = HFCausalLM(get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), lora))
    data = ByteWindows(text, length=48, stride=8)
    before = fitter.validate(module, data)["val/loss"]
    result = fitter.fit(module, data, data, resume="auto" if args.resume else None)
    if not fitter.strategy.is_global_zero:
        return
    print(f"loss on the text: {before:.3f} before, {result.metrics['val/loss']:.3f} after "
          f"({sum(p.numel() for p in module.parameters() if p.requires_grad)} trained parameters)")

    checkpoint = out / f"checkpoint-{result.global_step}"
    size = sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())
    adapter = export_hf(checkpoint, out / "adapter")  # the adapter folder; no base weights needed
    merged = export_hf(checkpoint, out / "merged", base=base_dir, merge=True)  # the base is checked
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter).eval()
    ids = data[0]["input_ids"][None]
    module.eval()
    with torch.no_grad():
        same = torch.equal(loaded(input_ids=ids).logits, module.model(input_ids=ids).logits)
        sample = loaded.generate(ids[:, :12], max_new_tokens=40, do_sample=False, pad_token_id=0)
    print(f"checkpoint {checkpoint.name}: {size} bytes; adapter exported to {adapter} "
          f"(PeftModel.from_pretrained gives the trained logits: {same}); merged model in {merged}")
    print(bytes(sample[0, 1:].tolist()).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    try:
        main()
    except ll.OutputDirError as error:
        sys.exit(f"{error}\n(with this example: --resume to continue it, --overwrite to replace it, "
                 "or --output-dir DIR)")

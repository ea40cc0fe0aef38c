"""Fine-tune a Hugging Face ``transformers`` text classifier with lightlike, export it for
``from_pretrained``, and check the reloaded model.

A tiny BERT (built from a ``BertConfig``: nothing is downloaded) learns a synthetic task: does
token 7 occur in the sequence? Sequences have different lengths, right-padded; the model computes
its own loss from ``labels`` and ``HFModel`` weighs every micro-batch by its number of items. At
the end the checkpoint is exported as an HF folder, loaded back with
``AutoModelForSequenceClassification.from_pretrained``, and its accuracy on the validation set is
computed anew: it equals the ``val/accuracy`` lightlike reported.

    pip install transformers
    python examples/hf_text_classifier.py            # seconds on a CPU
    python examples/hf_text_classifier.py --tiny     # fewer steps: what the tests run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

import lightlike as ll
from lightlike.interop import HFModel, export_hf

PAD, CLS, NEEDLE, VOCAB, MAX_LEN = 0, 1, 7, 100, 16


class ContainsNeedle(Dataset):
    """``CLS`` then 4-15 random tokens (never ``PAD`` or ``CLS``), right-padded to ``MAX_LEN``;
    in half of the items one of them is replaced by ``NEEDLE``. ``labels`` is 1 when ``NEEDLE``
    occurs, else 0."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, VOCAB, (n, MAX_LEN), generator=g)
        self.ids[self.ids == NEEDLE] = NEEDLE + 1  # a needle only where one is put
        self.lengths = torch.randint(5, MAX_LEN + 1, (n,), generator=g)
        where = (torch.rand(n, generator=g) * (self.lengths - 1)).long() + 1  # a position after CLS
        put = torch.rand(n, generator=g) < 0.5
        self.ids[put, where[put]] = NEEDLE
        self.ids[:, 0] = CLS

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(MAX_LEN) < self.lengths[i]).long()
        ids = self.ids[i].masked_fill(mask == 0, PAD)
        return {"input_ids": ids, "attention_mask": mask, "labels": (ids == NEEDLE).any().long()}


def build_model():
    from transformers import AutoModelForSequenceClassification, BertConfig

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_LEN, num_labels=2, pad_token_id=PAD,
                        id2label={0: "absent", 1: "present"}, label2id={"absent": 0, "present": 1})
    return AutoModelForSequenceClassification.from_config(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--output-dir", default="runs/hf_text_classifier")
    p.add_argument("--tiny", action="store_true", help="fewer steps (tests)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --output-dir")
    args = p.parse_args(argv)
    if args.tiny:
        args.max_steps, args.batch_size = 30, 16

    train, val = ContainsNeedle(2048, seed=0), ContainsNeedle(256, seed=1)
    fitter = ll.Fitter(max_steps=args.max_steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                       warmup_ratio=0.1, eval_every=args.max_steps, log_every=max(1, args.max_steps // 5),
                       save_every=args.max_steps, eval_batch_size=128, output_dir=args.output_dir,
                       overwrite_output_dir=args.overwrite, seed=0, model_summary=False, progress_bar=False)
    module = HFModel(build_model())  # built after the Fitter: seeded, the same every run
    result = fitter.fit(module, train, val)
    if not fitter.strategy.is_global_zero:
        return
    accuracy = result.metrics["val/accuracy"]
    print(f"val loss: {result.metrics['val/loss']:.4f}  val accuracy: {accuracy:.4f}")

    out = export_hf(Path(args.output_dir) / f"checkpoint-{result.global_step}", Path(args.output_dir) / "hf")
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    batch = torch.utils.data.default_collate([val[i] for i in range(len(val))])
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reloaded = (logits.argmax(-1) == batch["labels"]).double().mean().item()
    print(f"exported to {out}; accuracy of the reloaded model: {reloaded:.4f} "
          f"({loaded.config.id2label[1]!r} for {int(logits.argmax(-1).sum())} of {len(val)})")
    if abs(reloaded - accuracy) > 1e-12:
        sys.exit(f"the reloaded model's accuracy {reloaded} differs from the trained one's {accuracy}")


if __name__ == "__main__":
    try:
        main()
    except ll.OutputDirError as error:  # a second run into the same folder: say this script's flags
        sys.exit(f"{error}\n(with this example: --overwrite to replace it, or --output-dir DIR)")

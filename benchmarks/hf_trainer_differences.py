"""Where lightlike's numbers differ from the HF Trainer's, measured on one tiny BERT classifier.

The same ``BertForSequenceClassification`` (built from a config, no download), the same 16
items, batch 4, ``gradient_accumulation_steps=2``, SGD at a constant learning rate (Adam would
hide a scaled loss: its update does not depend on the gradient's scale), no clipping, trained
by the real ``transformers.Trainer``, by lightlike, and by a hand-written loop whose step is
the gradient of the mean loss over the window's items. Printed: each driver's logged loss of
every step beside the hand loop's, the largest weight difference to the hand loop, and the
learning rate each logs at a step of a linear schedule beside the rate that step used.

    python benchmarks/hf_trainer_differences.py

docs/migrating.md quotes its output. It needs transformers and accelerate (the Trainer's).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings

import torch

ITEMS, BATCH, ACCUM, LR, STEPS = 16, 4, 2, 0.5, 2


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def items() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (ITEMS, 8), generator=g)
    labels = torch.randint(0, 3, (ITEMS,), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels[i]}
            for i in range(ITEMS)]


def hand_loop(data: list[dict[str, torch.Tensor]]) -> tuple[torch.nn.Module, list[float]]:
    """The reference: each step the gradient of the mean loss over the window's 8 items."""
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        window = data[step * BATCH * ACCUM:(step + 1) * BATCH * ACCUM]
        total = 0.0
        for k in range(ACCUM):
            part = window[k * BATCH:(k + 1) * BATCH]
            batch = {key: torch.stack([it[key] for it in part]) for key in part[0]}
            loss = model(**batch).loss * len(part) / len(window)  # its share of the window's mean
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def hf_trainer(data: list[dict[str, torch.Tensor]], out: str, schedule: str = "constant") -> tuple[torch.nn.Module, list[dict]]:
    from transformers import Trainer, TrainingArguments

    model = tiny_bert()
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
                             learning_rate=LR, lr_scheduler_type=schedule, max_steps=STEPS, logging_steps=1,
                             max_grad_norm=0.0, optim="sgd", weight_decay=0.0, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, disable_tqdm=True)

    class InOrder(Trainer):  # the hand loop's order: no shuffling
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=args, train_dataset=data)
    trainer.train()
    return model, [r for r in trainer.state.log_history if "loss" in r]


def lightlike_fit(data: list[dict[str, torch.Tensor]], out: str, schedule: str = "constant") -> tuple[torch.nn.Module, list[dict]]:
    import lightlike as ll
    from lightlike.interop import HFModel

    module = HFModel(tiny_bert())
    fitter = ll.Fitter(batch_size=BATCH, grad_accum_steps=ACCUM, learning_rate=LR, lr_scheduler=schedule,
                       max_steps=STEPS, log_every=1, optimizer="sgd", shuffle=False, output_dir=out, loggers=[],
                       save_strategy="no", log_level="warning", model_summary=False)
    fitter.fit(module, data)
    return module.model, [r for r in fitter.state.log_history if "train/loss" in r]


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = items()
    ref, ref_losses = hand_loop(data)
    with tempfile.TemporaryDirectory() as tmp:
        hf, hf_rows = hf_trainer(data, os.path.join(tmp, "hf"))
        ll_model, ll_rows = lightlike_fit(data, os.path.join(tmp, "ll"))
        _, hf_lr = hf_trainer(data, os.path.join(tmp, "hf-lin"), "linear")
        _, ll_lr = lightlike_fit(data, os.path.join(tmp, "ll-lin"), "linear")
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}; BertForSequenceClassification, "
          f"{ITEMS} items, batch {BATCH}, gradient_accumulation_steps {ACCUM}, SGD lr {LR}, {STEPS} steps")
    for i in range(STEPS):
        print(f"step {i + 1}: logged loss  hand (mean over the window's items) {ref_losses[i]:.6f}   "
              f"HF Trainer {hf_rows[i]['loss']:.6f} ({hf_rows[i]['loss'] / ref_losses[i]:.3f}x)   "
              f"lightlike {ll_rows[i]['train/loss']:.6f} ({ll_rows[i]['train/loss'] / ref_losses[i]:.3f}x)")
    print(f"weights after {STEPS} steps, largest difference to the hand loop: HF Trainer {max_difference(hf, ref):.3g}, "
          f"lightlike {max_difference(ll_model, ref):.3g}")
    for i in range(STEPS):
        used = LR * (1 - i / STEPS)  # linear decay, no warmup: the rate step i + 1 used
        print(f"linear schedule, step {i + 1} used lr {used:g}: HF Trainer logs {hf_lr[i]['learning_rate']:g}, "
              f"lightlike logs {ll_lr[i]['train/lr']:g}")


if __name__ == "__main__":
    main()

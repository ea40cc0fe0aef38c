"""A LoRA fine-tune of a tiny Llama (float64, built from a config) that test_peft_strategies.py
launches as one plain process or under torchrun on gloo.

    torchrun --nproc_per_node 2 peft_target.py OUT --strategy ddp|fsdp [--steps N] [--batch B]
        [--stop N] [--resume] [--export] [--then OUT2 ...]

Writes ``final-rank{r}.pt`` (the full module state, gathered) and ``optim-rank0.pt`` (the
optimizer state, as ``get_optimizer_state_dict`` gives it in full, by parameter name), and with ``--export`` the
adapter folder of the newest checkpoint, ``OUT/adapter`` (rank 0 writes it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_target import StopAt, each  # noqa: E402

import lightlike as ll  # noqa: E402


def build_base():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)


def build_module():
    import peft

    from lightlike.interop.hf import HFCausalLM

    base = build_base()
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return HFCausalLM(peft.get_peft_model(base, lora))


def token_data(n=32, length=12):
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 64, (length,), generator=g)} for _ in range(n)]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stop", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--export", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    fitter = ll.Fitter(max_steps=args.steps, batch_size=args.batch, learning_rate=1e-2, save_every=2,
                       output_dir=str(out), seed=0, strategy=args.strategy, loggers=[], log_level="warning",
                       model_summary=False, progress_bar=False,
                       callbacks=[StopAt(args.stop)] if args.stop else [])
    fitter.fit(build_module(), token_data(), resume=True if args.resume else None)
    strategy = fitter.strategy
    rank = strategy.global_rank
    full = strategy.checkpoint_layout.module_state_dict(fitter.model)  # collective under FSDP
    torch.save({k: v.detach().clone().cpu() for k, v in full.items()}, out / f"final-rank{rank}.pt")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(strategy.unwrap(fitter.model), fitter.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the full state is on rank 0 (cpu_offload)
        torch.save(optim["state"], out / "optim-rank0.pt")
    if args.export:
        from lightlike.interop.hf import export_hf

        export_hf(fitter.checkpointer.final_checkpoint(), out / "adapter")  # rank 0 writes, the others return
        strategy.collectives.barrier()


if __name__ == "__main__":
    each(sys.argv[1:], run=main)

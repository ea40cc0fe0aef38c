"""NEFTune (``neftune_noise_alpha``): the paper's noise, per item's real length, in training only,
against a hand computation, transformers' own hook and a hand-written loop; the hooks leave the
module exactly as it came, after a fit that succeeds, fails or is preempted."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from helpers import flat_params
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightlike as ll
from lightlike.errors import ConfigError
from lightlike.interop.neftune import NEFTuneHooks, neftune_noise
from lightlike.preemption import Preempted

VOCAB, DIM, LENGTH = 20, 8, 6


class Padded(Dataset):
    """Token ids right-padded with 0 to LENGTH; real lengths 2..LENGTH; a class label."""

    def __init__(self, n: int = 24, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH)[None, :] < self.lengths[:, None]).long()
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g) * self.mask
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "y": self.y[i]}


class BagOfEmbeddings(ll.TaskModule):
    """Masked mean of token embeddings, then a linear classifier; names its embeddings. Records
    the embeddings its forward saw in eval mode (``seen_in_eval``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, 3)
        self.seen_in_eval: list[tuple[torch.Tensor, torch.Tensor]] = []

    def input_embeddings(self) -> nn.Module:
        return self.emb

    def forward(self, batch):
        h = self.emb(batch["input_ids"])
        if not self.training:
            self.seen_in_eval.append((h.detach().clone(), batch["input_ids"].clone()))
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])


def hooks_of(*modules: nn.Module) -> list[tuple]:
    return [(tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._forward_hooks_with_kwargs),
             tuple(m._forward_pre_hooks_with_kwargs)) for mod in modules for m in mod.modules()]


def captured(module: nn.Module, batch) -> torch.Tensor:
    """The embeddings ``module``'s forward gets for ``batch`` (a hook registered after NEFTune's)."""
    got = []
    handle = module.input_embeddings().register_forward_hook(lambda m, a, out: got.append(out.detach().clone()))
    try:
        module(batch)
    finally:
        handle.remove()
    return got[0]


def test_the_noise_is_the_papers_with_each_items_real_length_drawn_from_torchs_generator():
    module, data = BagOfEmbeddings(), Padded(n=4)
    batch = next(iter(DataLoader(data, batch_size=4)))
    clean = module.emb(batch["input_ids"]).detach()
    hooks = NEFTuneHooks(module, 5.0)
    try:
        torch.manual_seed(7)
        noisy = captured(module, batch)
    finally:
        hooks.remove()
    torch.manual_seed(7)  # by hand: U(-a_i, a_i), a_i = alpha / sqrt(L_i * d), L_i the item's real length
    lengths = batch["attention_mask"].sum(1).tolist()
    scale = 5.0 / torch.sqrt(torch.tensor(lengths, dtype=torch.float32) * DIM)
    expected = torch.empty(4, LENGTH, DIM).uniform_(-1, 1) * scale.view(4, 1, 1)
    assert len(set(lengths)) > 1, "the batch must mix real lengths"
    assert torch.equal(noisy, clean + expected)
    for i, n in enumerate(lengths):  # each item's noise stays within its own bound, and reaches near it
        bound = 5.0 / math.sqrt(n * DIM)
        assert (noisy[i] - clean[i]).abs().max() <= bound * (1 + 1e-6)
        assert (noisy[i] - clean[i]).abs().max() > 0.9 * bound


def test_without_a_mask_the_noise_is_transformers_own_neftune_hooks():
    """No attention_mask (a tensor batch): the padded length, as the HF Trainer's hook uses."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    emb = nn.Embedding(VOCAB, DIM)
    ids = torch.randint(0, VOCAB, (3, LENGTH))
    out = emb(ids).detach()
    torch.manual_seed(3)
    ours = out + neftune_noise(out, 10.0)
    emb.neftune_noise_alpha = 10.0
    torch.manual_seed(3)
    theirs = neftune_post_forward_hook(emb, (ids,), out)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert not torch.equal(ours, out)


def test_a_fit_with_neftune_equals_a_hand_written_loop_with_the_same_hook(tmp_path):
    data, steps, alpha, seed = Padded(n=24), 5, 5.0, 11
    torch.manual_seed(0)
    ours = BagOfEmbeddings()
    torch.manual_seed(0)
    ref = BagOfEmbeddings()
    fitter = ll.Fitter(max_steps=steps, batch_size=4, learning_rate=1e-2, shuffle=False, seed=seed, max_grad_norm=None,
                       neftune_noise_alpha=alpha, output_dir=str(tmp_path), loggers=[], model_summary=False,
                       accelerator="cpu")
    fitter.fit(ours, data)

    state = {}  # by hand: the paper's noise scaled by each item's attention_mask sum
    ref.register_forward_pre_hook(lambda m, args: state.update(mask=args[0]["attention_mask"]))

    def noise(m, args, out):
        if m.training:
            a = alpha / torch.sqrt(state["mask"].sum(1).float() * out.shape[-1])
            return out + torch.empty_like(out).uniform_(-1, 1) * a[:, None, None]
        return None

    ref.emb.register_forward_hook(noise)
    opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.ndim >= 2], "weight_decay": 0.0},
                             {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    batches = list(DataLoader(data, batch_size=4))[:steps]  # (a DataLoader's iterator draws from the generator)
    torch.manual_seed(seed)  # the Fitter seeds it at set-up
    for batch in batches:
        ref.loss(ref(batch), batch).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    assert torch.equal(flat_params(ours), flat_params(ref)), "weights differ from the hand-written loop"
    torch.manual_seed(0)
    plain = BagOfEmbeddings()
    ll.Fitter(max_steps=steps, batch_size=4, learning_rate=1e-2, shuffle=False, seed=seed,
              output_dir=str(tmp_path / "plain"), loggers=[], model_summary=False, accelerator="cpu").fit(plain, data)
    assert not torch.equal(flat_params(plain), flat_params(ours)), "the noise changed nothing"


def test_evaluation_and_prediction_see_no_noise_during_and_outside_a_fit(tmp_path):
    module, data = BagOfEmbeddings(), Padded(n=16)
    fitter = ll.Fitter(max_steps=4, batch_size=4, eval_every=2, neftune_noise_alpha=15.0, output_dir=str(tmp_path),
                       loggers=[], model_summary=False, accelerator="cpu")
    fitter.fit(module, data, val=Padded(n=8, seed=1))
    fitter.validate(module, Padded(n=8, seed=1))
    fitter.predict(module, Padded(n=8, seed=1))
    assert len(module.seen_in_eval) >= 6  # 2 mid-fit evaluations, validate, predict
    for h, ids in module.seen_in_eval:  # what the embeddings' weights give, at that moment, is not
        # known after the fact; the lookup is exact, so the rows of one id must agree within a call
        for token in ids.unique().tolist():
            rows = h[ids == token]
            assert torch.equal(rows, rows[:1].expand_as(rows)), "an evaluation saw noisy embeddings"
    h, ids = module.seen_in_eval[-1]
    assert torch.equal(h, module.emb.weight.detach()[ids])


class FailsAt(BagOfEmbeddings):
    def __init__(self, step: int):
        super().__init__()
        self.calls, self.fail_at = 0, step

    def loss(self, outputs, batch):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom")
        return super().loss(outputs, batch)


class SignalAt2(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.parametrize("exit", ["success", "failure", "preemption"])
def test_no_hook_is_left_behind(tmp_path, exit):
    module = FailsAt(3 if exit == "failure" else 0)
    before = hooks_of(module)
    seen: list[bool] = []

    class HooksOn(ll.Callback):
        def on_step_end(self, fitter, state, control):
            seen.append(hooks_of(module) != before)

    kwargs = {"preemption_signals": ["SIGUSR1"], "requeue_on_preemption": False} if exit == "preemption" else {}
    callbacks = [HooksOn()] + ([SignalAt2()] if exit == "preemption" else [])
    fitter = ll.Fitter(max_steps=4, batch_size=4, neftune_noise_alpha=5.0, output_dir=str(tmp_path), loggers=[],
                       model_summary=False, accelerator="cpu", callbacks=callbacks, **kwargs)
    if exit == "success":
        fitter.fit(module, Padded(n=16))
    elif exit == "failure":
        with pytest.raises(RuntimeError, match="boom"):
            fitter.fit(module, Padded(n=16))
    else:
        with pytest.raises(Preempted) as e:
            fitter.fit(module, Padded(n=16))
        assert e.value.code == 75
    assert seen and all(seen)
    assert hooks_of(module) == before
    assert not any(hasattr(m, "neftune_noise_alpha") for m in module.modules())


def test_a_resumed_fit_draws_the_same_noise_as_one_that_ran_through(tmp_path):
    data = Padded(n=32)
    common = dict(batch_size=4, neftune_noise_alpha=5.0, seed=3, loggers=[], model_summary=False, accelerator="cpu")
    torch.manual_seed(0)
    straight = BagOfEmbeddings()
    ll.Fitter(max_steps=6, output_dir=str(tmp_path / "a"), **common).fit(straight, data)
    torch.manual_seed(0)
    first = BagOfEmbeddings()
    ll.Fitter(max_steps=6, output_dir=str(tmp_path / "b"), **common, callbacks=[StopAfter(3)], save_every=3).fit(first, data)
    torch.manual_seed(1)
    resumed = BagOfEmbeddings()
    ll.Fitter(max_steps=6, output_dir=str(tmp_path / "b"), **common).fit(resumed, data, resume=True)
    assert torch.equal(flat_params(straight), flat_params(resumed))


class StopAfter(ll.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_a_module_without_named_embeddings_and_a_bad_alpha_are_one_error_at_set_up(tmp_path):
    from helpers import Classifier, DictDataset

    fitter = ll.Fitter(max_steps=2, batch_size=4, neftune_noise_alpha=5.0, output_dir=str(tmp_path), loggers=[],
                       accelerator="cpu")
    module = Classifier()
    before = hooks_of(module)
    with pytest.raises(ConfigError, match="input_embeddings"):
        fitter.fit(module, DictDataset(n=8))
    assert fitter.state.global_step == 0 and hooks_of(module) == before
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="neftune_noise_alpha must be a finite number > 0"):
            ll.Fitter(max_steps=2, neftune_noise_alpha=bad, output_dir=str(tmp_path), loggers=[])
        with pytest.raises(ConfigError, match="neftune_noise_alpha must be a finite number > 0"):
            NEFTuneHooks(BagOfEmbeddings(), bad)


def test_an_hf_causal_lm_gets_the_noise_on_its_input_embeddings(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightlike.interop import HFCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    module = HFCausalLM(model)
    data = Padded(n=4)
    batch = next(iter(DataLoader(data, batch_size=4)))
    embeddings = model.get_input_embeddings()
    before = hooks_of(module)
    hooks = NEFTuneHooks(module, 5.0)
    assert hooks.embeddings is embeddings
    got = []
    handle = embeddings.register_forward_hook(lambda m, a, out: got.append(out.detach().clone()))
    try:
        torch.manual_seed(2)
        module.train()
        module(batch)
        module.eval()
        module(batch)
    finally:
        handle.remove()
        hooks.remove()
    clean = embeddings(batch["input_ids"]).detach()
    torch.manual_seed(2)
    assert torch.equal(got[0], clean + neftune_noise(clean, 5.0, batch["attention_mask"]))
    assert torch.equal(got[1], clean)
    assert hooks_of(module) == before


def test_under_ddp_each_rank_adds_the_papers_noise_and_leaves_no_hook(tmp_path):
    """Two processes (torchrun, gloo): every training forward's embeddings, as the DDP-wrapped
    module made them, equal the hand-computed noise (real lengths) from that moment's random state."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launching import SCRIPTS, run_ok

    run_ok(2, tmp_path, script=SCRIPTS / "neftune_target.py")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        assert got["checks"] == [True] * 4 and got["neftune_on_during_fit"] and got["hooks_left"] == 0
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_a_seq2seq_models_decoder_input_takes_its_own_mask_or_the_padded_length():
    """T5 embeds the encoder's and the decoder's inputs with one shared embedding: the encoder's
    items take their attention_mask lengths, the decoder's (of the same length here) theirs from
    decoder_attention_mask, or the padded length without it, never the encoder's."""
    from transformers import T5Config, T5ForConditionalGeneration

    from lightlike.interop import HFModel

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                             decoder_start_token_id=0, pad_token_id=0))
    module, shared = HFModel(t5), t5.encoder.embed_tokens  # tied to get_input_embeddings(), which is never called
    assert shared is not t5.get_input_embeddings() and t5.decoder.embed_tokens.weight is shared.weight
    data = Padded(n=4)
    batch = next(iter(DataLoader(data, batch_size=4)))
    encoder_mask = batch.pop("attention_mask")
    batch = {"input_ids": batch["input_ids"], "attention_mask": encoder_mask, "labels": batch["input_ids"].roll(1, 1)}
    decoder_mask = torch.ones_like(encoder_mask)
    decoder_mask[:, -2:] = 0
    calls: list[tuple] = []
    hooks = NEFTuneHooks(module, 5.0)
    handles = []
    for embeddings in (t5.encoder.embed_tokens, t5.decoder.embed_tokens):
        handles += [embeddings.register_forward_pre_hook(lambda m, a: calls.append((a[0].clone(), torch.get_rng_state()))),
                    embeddings.register_forward_hook(lambda m, a, out: calls.append(out.detach().clone()))]
    try:
        module.train()
        module(batch)
        module({**batch, "decoder_attention_mask": decoder_mask})
    finally:
        for handle in handles:
            handle.remove()
        hooks.remove()
    assert len(calls) == 8  # (input, state) and output, encoder and decoder, twice
    decoder_lengths = [torch.full((4,), LENGTH), decoder_mask.sum(1)]
    for forward in range(2):
        for side, lengths in ((0, encoder_mask.sum(1)), (1, decoder_lengths[forward])):
            (ids, state), noisy = calls[4 * forward + 2 * side], calls[4 * forward + 2 * side + 1]
            g = torch.Generator()
            g.set_state(state)
            scale = 5.0 / torch.sqrt(lengths.to(torch.float32) * 16)
            clean = nn.functional.embedding(ids, shared.weight).detach()
            expected = clean + torch.empty(clean.shape).uniform_(-1, 1, generator=g) * scale.view(-1, 1, 1)
            assert torch.equal(noisy, expected), (forward, side)
    assert not torch.equal(encoder_mask.sum(1), torch.full((4,), LENGTH))


def test_embeddings_recomputed_outside_the_modules_forward_are_one_clear_error():
    """Activation checkpointing around the embeddings recomputes them in backward, where the
    items' lengths are unknown: an error, not noise of another scale than the forward's."""
    from torch.utils.checkpoint import checkpoint

    from lightlike.errors import ModuleContractError

    class CheckpointedEmbeddings(BagOfEmbeddings):
        def forward(self, batch):
            h = checkpoint(lambda ids: torch.tanh(self.emb(ids)), batch["input_ids"], use_reentrant=False)
            m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1))

    module = CheckpointedEmbeddings()
    batch = next(iter(DataLoader(Padded(n=4), batch_size=4)))
    hooks = NEFTuneHooks(module, 5.0)
    try:
        loss = module.loss(module(batch), batch)
        with pytest.raises(ModuleContractError, match="outside the module's forward"):
            loss.backward()
    finally:
        hooks.remove()


def test_a_training_forward_that_never_calls_the_named_embeddings_is_an_error_not_a_fit_without_noise(tmp_path):
    class NamesAnother(BagOfEmbeddings):
        def __init__(self):
            super().__init__()
            self.unused = nn.Embedding(VOCAB, DIM)

        def input_embeddings(self):
            return self.unused

    from lightlike.errors import ModuleContractError

    module = NamesAnother()
    before = hooks_of(module)
    fitter = ll.Fitter(max_steps=2, batch_size=4, neftune_noise_alpha=5.0, output_dir=str(tmp_path), loggers=[],
                       model_summary=False, accelerator="cpu")
    with pytest.raises(ModuleContractError, match="never called its input embeddings"):
        fitter.fit(module, Padded(n=8))
    assert fitter.state.global_step == 0 and hooks_of(module) == before

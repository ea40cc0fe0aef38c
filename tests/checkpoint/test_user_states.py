"""``Fitter(states={"ema": ema})``: a user's own state, saved in every checkpoint (listed in the
manifest, read with ``weights_only=True``) and restored before the first step of a resumed fit,
so that the resumed run ends with the same state bit for bit, on every strategy."""

from __future__ import annotations

import contextlib
import importlib.util
import json

import numpy as np
import pytest
import torch
from helpers import EMA, DictDataset, Dropout, KeepsEMA, StopAt
from launching import run_each_ok

import lightlike as ll
from lightlike.checkpoint.files import BUILT_IN_NAMES


def fit(out, ema=None, stop=None, resume=None, callbacks=(), **kw):
    """A fit of ``Dropout()`` (seeded) keeping ``ema`` as the user state ``"ema"``; ``stop``:
    killed (KeyboardInterrupt) right after that step. Returns the Fitter."""
    cfg = dict(max_steps=8, batch_size=4, grad_accum_steps=2, save_every=2, output_dir=str(out), loggers=[],
               learning_rate=1e-2, warmup_steps=2)
    cfg.update(kw)
    torch.manual_seed(0)
    module = Dropout()
    kept = [KeepsEMA(ema)] if ema is not None else []
    fitter = ll.Fitter(callbacks=[*kept, *callbacks, *([StopAt(stop)] if stop else [])],
                       states={"ema": ema} if ema is not None else None, **cfg)
    with contextlib.suppress(KeyboardInterrupt):
        fitter.fit(module, DictDataset(n=40), resume=resume)
    return fitter


class SeenAtStart(ll.Callback):
    """The EMA's update count when the fit starts (before its first step)."""

    def __init__(self, ema):
        self.ema, self.updates = ema, None

    def on_fit_start(self, fitter, state, control):
        self.updates = self.ema.updates


def test_a_user_state_killed_and_resumed_ends_bit_for_bit_as_the_uninterrupted_run(tmp_path):
    """Killed right after step 5 (its newest checkpoint: 4); the resumed fit, with a fresh EMA
    object, finds it restored before its first step (4 updates) and ends with the uninterrupted
    run's EMA tensor and counter, bit for bit."""
    ref = EMA()
    fit(tmp_path / "ref", ref)
    fit(tmp_path / "cut", EMA(), stop=5)
    ema = EMA()
    seen = SeenAtStart(ema)
    fitter = fit(tmp_path / "cut", ema, resume=True, callbacks=[seen])
    assert fitter.resumed_from.endswith("checkpoint-4") and fitter.state.global_step == 8
    assert seen.updates == 4
    assert ema.updates == ref.updates == 8
    assert torch.equal(ema.shadow, ref.shadow)
    assert fitter.states == {"ema": ema}


def test_the_state_file_is_in_every_full_checkpoint_and_its_manifest(tmp_path):
    """``state-ema.pt`` in each checkpoint, listed in its manifest, holding the state as it was at
    that step; a weights-only checkpoint (``save_only_model``) holds no training state: no state."""
    fit(tmp_path / "run", EMA(), max_steps=4)
    for step in (2, 4):
        ckpt = tmp_path / "run" / f"checkpoint-{step}"
        assert "state-ema.pt" in json.loads((ckpt / "manifest.json").read_text())["files"]
        saved = torch.load(ckpt / "state-ema.pt", weights_only=True)
        assert saved["updates"] == step and saved["shadow"].dtype == torch.float64
    fit(tmp_path / "model-only", EMA(), max_steps=2, save_only_model=True)
    assert not (tmp_path / "model-only" / "checkpoint-2" / "state-ema.pt").exists()


@pytest.mark.parametrize("name", ["rng", "optimizer", "model", "trainer_state", "config"])
def test_a_name_that_collides_with_a_built_in_entry_is_refused(name):
    with pytest.raises(ll.ConfigError) as caught:
        ll.Fitter(max_steps=1, states={name: EMA()})
    message = str(caught.value)
    assert f"{name!r} is a built-in entry" in message
    assert all(built_in in message for built_in in BUILT_IN_NAMES)


@pytest.mark.parametrize("value, expected", [
    (torch.zeros(3), "a Tensor has no state_dict and no load_state_dict()"),
    (type("OnlySaves", (), {"state_dict": lambda self: {}})(), "a OnlySaves has no load_state_dict()"),
])
def test_a_state_without_state_dict_and_load_state_dict_is_refused_at_construction(value, expected):
    with pytest.raises(ll.ConfigError, match="states=") as caught:
        ll.Fitter(max_steps=1, states={"ema": value})
    assert expected in str(caught.value)


@pytest.mark.parametrize("states", [[EMA()], {"../ema": EMA()}, {"": EMA()}, {3: EMA()}])
def test_states_must_be_a_dict_of_file_safe_names(states):
    with pytest.raises(ll.ConfigError, match="states="):
        ll.Fitter(max_steps=1, states=states)


def test_a_damaged_state_file_fails_verification(tmp_path):
    fit(tmp_path / "run", EMA(), max_steps=4)
    ckpt = tmp_path / "run" / "checkpoint-4"
    data = bytearray((ckpt / "state-ema.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # a bit flip, same size
    (ckpt / "state-ema.pt").write_bytes(bytes(data))
    with pytest.raises(ll.CheckpointError, match="state-ema.pt"):
        fit(tmp_path / "run", EMA(), max_steps=6, resume=str(ckpt))


class Payload:
    """Unpickling it would create ``path``: what ``weights_only=True`` must refuse to run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_pickle_payload_in_a_state_file_is_refused(tmp_path):
    """A state file holding a pickled call (its manifest entry made to match) is not run: the
    resume refuses it, naming the file and weights_only=True."""
    fit(tmp_path / "run", EMA(), max_steps=4)
    ckpt, marker = tmp_path / "run" / "checkpoint-4", tmp_path / "payload-ran"
    torch.save({"shadow": Payload(marker), "updates": 4}, ckpt / "state-ema.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state-ema.pt"]["size"] = (ckpt / "state-ema.pt").stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ll.CheckpointError, match=r"state-ema.pt \(ema\).*weights_only=True"):
        fit(tmp_path / "run", EMA(), max_steps=6, resume=str(ckpt), verify_hashes=False)
    assert not marker.exists()


def test_a_checkpoint_without_a_state_the_fit_names_is_refused_by_name(tmp_path, caplog):
    """Resuming a checkpoint written without ``ema`` with ``states={"ema": ...}`` is refused before
    anything is restored, naming the state and the checkpoint; a state the checkpoint holds and the
    resumed fit does not name is left, with a warning."""
    fit(tmp_path / "plain", max_steps=2)
    with pytest.raises(ll.CheckpointError) as caught:
        fit(tmp_path / "plain", EMA(), max_steps=4, resume=True)
    assert "holds no state 'ema' (state-ema.pt)" in str(caught.value)
    assert str(tmp_path / "plain" / "checkpoint-2") in str(caught.value)
    fit(tmp_path / "with", EMA(), max_steps=2)
    with caplog.at_level("WARNING", logger="lightlike"):
        fitter = fit(tmp_path / "with", max_steps=4, resume=True)
    assert fitter.state.global_step == 4
    assert "holds state 'ema' (state-ema.pt), which this fit does not name in states=" in caplog.text


class NumpyCount(EMA):
    def state_dict(self):
        return {"shadow": self.shadow, "updates": np.int64(self.updates)}


def test_a_state_no_resume_could_load_is_refused_at_the_first_save(tmp_path):
    with pytest.raises(ll.CheckpointError) as caught:
        fit(tmp_path / "run", NumpyCount(), max_steps=4)
    assert "states['ema']: its state_dict()['updates'] holds a numpy.int64" in str(caught.value)
    assert not list((tmp_path / "run").glob("checkpoint-*"))


# -- every strategy, on two processes ------------------------------------------------------------
STRATEGIES = ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
COMMON = ["--steps", "7", "--items", "40", "--batch", "4", "--accum", "2", "--save-every", "2", "--dtype", "float32",
          "--ema"]


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    """For each strategy: a run stopped after step 5 (its checkpoint-5), resumed into the same
    folder, and the uninterrupted run; all in one launch of two processes (``--then``).
    {strategy: (resumed folder, reference folder)}."""
    base = tmp_path_factory.mktemp("user-states")
    runs, outs = [], {}
    for strategy in STRATEGIES:
        if strategy.startswith("deepspeed") and not HAVE_DEEPSPEED:
            continue
        args = ["--strategy", strategy, *COMMON]
        cut, ref = base / f"{strategy}-cut", base / f"{strategy}-ref"
        runs += [(cut, [*args, "--stop", "5"]), (cut, [*args, "--resume"]), (ref, args)]
        outs[strategy] = (cut, ref)
    run_each_ok(2, runs)
    return outs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_user_state_stopped_and_resumed_ends_bit_for_bit_on_every_strategy(stopped_and_resumed, strategy):
    """An EMA of the full weights (gathered from the shards under FSDP and ZeRO) kept by a
    callback: stopped after step 5 and resumed on two processes, every rank ends with the
    uninterrupted run's EMA tensor and counter, bit for bit (and the same weights)."""
    if strategy.startswith("deepspeed") and not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    cut, ref = stopped_and_resumed[strategy]
    assert (cut / "checkpoint-4" / "state-ema.pt").is_file()
    for rank in (0, 1):
        got = torch.load(cut / f"ema-rank{rank}.pt", weights_only=True)
        want = torch.load(ref / f"ema-rank{rank}.pt", weights_only=True)
        assert got["updates"] == want["updates"] == 7, rank
        assert torch.equal(got["shadow"], want["shadow"]), f"rank {rank}: the EMA differs"
        a = torch.load(cut / f"final-rank{rank}.pt", weights_only=True)
        b = torch.load(ref / f"final-rank{rank}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in b), f"rank {rank}: the weights differ"

"""BE mutation round: what a training checkpoint holds (lightlike/checkpoint/training.py)."""
import contextlib
import json
import random

import numpy as np
import pytest
import torch
from helpers import Classifier, DictDataset, StopAt

import lightlike as ll


def test_rng_file_holds_the_exact_streams_of_the_save(tmp_path):
    """rng.pt of a checkpoint, loaded with weights_only=True and put back by hand, continues
    python/numpy/torch exactly where the process stood when it saved."""
    seen = {}

    class Peek(ll.Callback):
        def on_save(self, fitter, state, control, path):
            if state.global_step == 2:
                st = (random.getstate(), np.random.get_state(), torch.get_rng_state())
                seen["next"] = (random.gauss(0, 1), float(np.random.normal()), torch.rand(3))
                random.setstate(st[0])
                np.random.set_state(st[1])
                torch.set_rng_state(st[2])

    class Draw(Classifier):
        def forward(self, batch):
            if self.training:
                random.gauss(0, 1)
                np.random.normal()
            return self.net(batch["x"])

    ll.Fitter(max_steps=2, batch_size=4, save_every=2, output_dir=str(tmp_path), loggers=[], seed=1,
              callbacks=[Peek()]).fit(Draw(), DictDataset(n=16))
    rngs = torch.load(tmp_path / "checkpoint-2" / "rng.pt", weights_only=True)
    assert len(rngs) == 1
    r = rngs[0]
    version, internal, gauss = r["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = r["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(r["torch"])
    a, b, c = random.gauss(0, 1), float(np.random.normal()), torch.rand(3)
    assert (a, b) == seen["next"][:2] and torch.equal(c, seen["next"][2])


class OddHparams(Classifier):
    def __init__(self, features: int = 8, classes: int = 3, width: int = 16, dtype=torch.float64, tags=("a", 1)):
        super().__init__(features, classes, width)
        self.hparams.clear()
        self.save_hyperparameters()


def test_hparams_that_json_cannot_hold_are_written_as_their_repr(tmp_path):
    """hparams.json keeps every hyperparameter: JSON values as they are, others as repr()
    (mutant T38 dropped them)."""
    ll.Fitter(max_steps=1, batch_size=4, save_every=1, output_dir=str(tmp_path), loggers=[]).fit(
        OddHparams(), DictDataset(n=8))
    h = json.loads((tmp_path / "checkpoint-1" / "hparams.json").read_text())
    assert h == {"features": 8, "classes": 3, "width": 16, "dtype": "torch.float64", "tags": ["a", 1]}


class Evil:
    ran = []

    def __reduce__(self):
        return (Evil.ran.append, ("executed",))


def test_resume_loads_checkpoint_pickles_with_weights_only(tmp_path):
    """A callbacks.pt holding an arbitrary pickled object (manifest updated to match, as a
    tampered or foreign checkpoint would be) is refused on resume, and the object's code never
    runs: the files are read with torch.load(weights_only=True) (mutant T39)."""
    import zlib

    out = tmp_path / "run"
    ll.Fitter(max_steps=2, batch_size=4, save_every=2, output_dir=str(out), loggers=[]).fit(
        Classifier(), DictDataset(n=16))
    ckpt = out / "checkpoint-2"
    torch.save({"x": Evil()}, ckpt / "callbacks.pt")
    m = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "callbacks.pt").read_bytes()
    m["files"]["callbacks.pt"] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (ckpt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|unsupported"):
        ll.Fitter(max_steps=4, batch_size=4, save_every=2, output_dir=str(out), loggers=[]).fit(
            Classifier(), DictDataset(n=16), resume=str(ckpt))
    assert Evil.ran == []


def test_pending_losses_go_to_their_own_rank_or_all_to_rank_0():
    """trainer_state's pending_per_rank: on the same world size each rank takes its own list;
    on another world size rank 0 takes all of them and the others none (mutants T30-T32)."""
    from lightlike.checkpoint.training import pending_for_rank

    saved = [[[1.0, 2, 3, 0]], [[4.0, 5, 3, 0], [6.0, 1, 3, 1]]]
    assert pending_for_rank(saved, 0, 2) == [[1.0, 2, 3, 0]]
    assert pending_for_rank(saved, 1, 2) == [[4.0, 5, 3, 0], [6.0, 1, 3, 1]]
    assert pending_for_rank(saved, 0, 3) == [[1.0, 2, 3, 0], [4.0, 5, 3, 0], [6.0, 1, 3, 1]]
    assert pending_for_rank(saved, 1, 3) == [] and pending_for_rank(saved, 2, 1) == []


def test_the_first_log_after_a_resume_averages_the_losses_saved_as_pending(tmp_path):
    """log_every=4, save_every=2, killed after step 3: checkpoint-2 holds the unlogged losses
    of steps 1-2 (trainer_state pending_per_rank), and the resumed run's step-4 train/loss is the
    uninterrupted run's, which averages steps 1-4 (mutant T15 dropped them on load)."""
    def run(out, stop=None, resume=None):
        torch.manual_seed(0)
        fitter = ll.Fitter(max_steps=4, batch_size=4, save_every=2, log_every=4, output_dir=str(out), loggers=[],
                           learning_rate=1e-1, seed=2, callbacks=[StopAt(stop)] if stop else [])
        with contextlib.suppress(KeyboardInterrupt):
            return fitter.fit(Classifier(), DictDataset(n=32), resume=resume)

    ref = run(tmp_path / "ref")
    saved = json.loads((tmp_path / "ref" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [len(p) for p in saved["pending_per_rank"]] == [2]
    run(tmp_path / "cut", stop=3)
    resumed = run(tmp_path / "cut", resume=True)

    def logs(r):
        return [(h["step"], h["train/loss"]) for h in r.state.log_history if "train/loss" in h]
    assert logs(resumed) == logs(ref) and [s for s, _ in logs(ref)] == [4]


class _FakeCuda:
    """torch.cuda's random-state calls, recorded (this machine has no GPU)."""

    def __init__(self, monkeypatch, count, current):
        self.calls = []
        for name, value in {"is_available": lambda: True, "is_initialized": lambda: True,
                            "device_count": lambda: count, "current_device": lambda: current,
                            "get_rng_state_all": lambda: [torch.tensor([i]) for i in range(count)],
                            "set_rng_state_all": lambda states: self.calls.append(("all", [int(t) for t in states])),
                            "set_rng_state": lambda state: self.calls.append(("current", int(state)))}.items():
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.mark.parametrize("saved_on, resumed_on, expected", [
    ((8, 3), (8, 3), [("all", list(range(8)))]),  # the same GPUs: every generator as saved
    ((8, 3), (1, 0), [("current", 3)]),   # torchrun saw the node, SLURM gives the task one GPU
    ((1, 0), (8, 5), [("current", 0)]),   # the other way round
])
def test_cuda_random_state_resumes_onto_the_gpu_computed_on_whatever_the_gpus_visible(
        monkeypatch, saved_on, resumed_on, expected):
    """``set_rng_state_all`` with a list of another length failed on a GPU that does not exist,
    or gave the GPU computed on another GPU's stream."""
    from lightlike.utils.seed import rng_state, set_rng_state

    _FakeCuda(monkeypatch, *saved_on)
    state = rng_state()
    assert state["cuda_device"] == saved_on[1]
    fake = _FakeCuda(monkeypatch, *resumed_on)
    set_rng_state(state)
    assert fake.calls == expected


def test_cuda_random_state_of_an_older_checkpoint_goes_by_the_local_rank(monkeypatch):
    """Checkpoints written before the saving GPU was recorded: a rank that saw its whole node
    computed on cuda:LOCAL_RANK."""
    from lightlike.utils.seed import rng_state, set_rng_state

    _FakeCuda(monkeypatch, 4, 2)
    state = rng_state()
    del state["cuda_device"]
    fake = _FakeCuda(monkeypatch, 1, 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    set_rng_state(state)
    assert fake.calls == [("current", 2)]

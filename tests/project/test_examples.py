"""The examples run end to end, and the flagship model behaves like a language model."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightlike as ll

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def _load_char_gpt():
    spec = importlib.util.spec_from_file_location("char_gpt_example", EXAMPLES / "char_gpt.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def char_gpt():
    return _load_char_gpt()


# ------------------------------------------------------------------------------------------------
# the example programs, as a user runs them
# ------------------------------------------------------------------------------------------------
def test_char_gpt_tiny_run(tmp_path):
    out = tmp_path / "run"
    proc = _run([str(EXAMPLES / "char_gpt.py"), "--tiny", "--output-dir", str(out)], cwd=tmp_path)
    stdout = proc.stdout

    checkpoints = sorted(p for p in out.glob("checkpoint-*") if p.is_dir())
    assert checkpoints, f"no checkpoint-N directory in {out}: {sorted(p.name for p in out.iterdir())}"
    assert all((p / "manifest.json").is_file() for p in checkpoints)
    assert (out / "checkpoint-6" / "manifest.json").is_file()  # the last step is saved

    if importlib.util.find_spec("tensorboard") is not None:
        events = list((out / "logs").rglob("events.out.tfevents*"))
        assert events, f"no TensorBoard event files under {out / 'logs'}"

    m = re.search(r"final val loss: (\S+)", stdout)
    assert m, stdout
    assert math.isfinite(float(m.group(1)))
    # the evaluation loss goes down between the run's two evaluations (steps 3 and 6)
    val = [float(v) for v in re.findall(r"step +\d+/6 +val/loss (\S+)", stdout)]
    assert len(val) == 2 and val[1] < val[0], stdout

    m = re.search(r"sample:\n-+\n(.*?)\n-+\n", stdout, flags=re.S)
    assert m, stdout
    assert m.group(1).startswith("def ") and len(m.group(1)) > len("def ")


def test_char_gpt_refuses_to_overwrite_then_overwrites_reproducibly(tmp_path):
    out = tmp_path / "run"
    args = [str(EXAMPLES / "char_gpt.py"), "--tiny", "--output-dir", str(out)]
    first = _run(args, cwd=tmp_path).stdout
    again = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "overwrite" in again.stderr
    second = _run([*args, "--overwrite"], cwd=tmp_path).stdout

    def final_line(stdout: str) -> str:
        return next(line for line in stdout.splitlines() if line.startswith("final val loss"))

    assert final_line(first) == final_line(second)  # same seed, same numbers


def test_char_gpt_resume_continues_a_run_killed_before_its_first_save(tmp_path):
    """A run killed before its first checkpoint leaves only logs/: the example's hint says
    --resume, which then failed (resume=True, nothing to resume) with a hint to start without
    it, which is refused. --resume now starts such a run afresh (what was there moved aside)."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    args = [str(EXAMPLES / "char_gpt.py"), "--tiny", "--output-dir", str(out)]
    again = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "--resume to continue it" in again.stderr
    proc = _run([*args, "--resume"], cwd=tmp_path)
    assert "final val loss" in proc.stdout
    assert [p.name.startswith("abandoned-") for p in out.iterdir() if p.name not in ("logs",)].count(True) == 1


def test_char_gpt_resume_of_a_finished_run_says_nothing_was_trained(tmp_path):
    """--resume of a finished run printed "trained 6 steps in 0 s" (nothing was trained). It says
    nothing was left to train; --help of the classifier example prints its help and trains nothing
    (it trained and replaced runs/classifier)."""
    out = tmp_path / "run"
    args = [str(EXAMPLES / "char_gpt.py"), "--tiny", "--output-dir", str(out)]
    assert "trained 6 steps in" in _run(args, cwd=tmp_path).stdout
    again = _run([*args, "--resume"], cwd=tmp_path).stdout
    assert f"nothing left to train: {out / 'checkpoint-6'} is at step 6, this run's last" in again, again
    assert "trained 6 steps" not in again
    helped = _run([str(EXAMPLES / "classifier.py"), "--help"], cwd=tmp_path)
    assert "README's one-screen program" in helped.stdout and not (tmp_path / "runs").exists()


def test_classifier_example(tmp_path):
    proc = _run([str(EXAMPLES / "classifier.py")], cwd=tmp_path)
    step, training_loss, accuracy = proc.stdout.strip().splitlines()[-1].split()
    assert int(step) == 300
    assert math.isfinite(float(training_loss))
    assert float(accuracy) > 0.5, proc.stdout
    assert (tmp_path / "runs" / "classifier" / "checkpoint-300" / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------------
# the model itself
# ------------------------------------------------------------------------------------------------
def _tiny(char_gpt, vocab_size: int, block_size: int = 16):
    torch.manual_seed(0)
    return char_gpt.CharGPT(vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32)


def test_data_pipeline(char_gpt):
    vocab = char_gpt.CharVocab.build("abcabc")
    assert len(vocab) == 4 and vocab.decode(vocab.encode("cab")) == "cab"
    assert vocab.encode("a?").tolist()[1] == 0  # unseen characters map to <unk>
    data = torch.arange(20)
    ds = char_gpt.CharWindows(data, block_size=4)
    assert len(ds) == 4  # offsets 0, 4, 8, 12 (the next one would need data[16:21])
    item = ds[3]
    assert item["idx"].tolist() == [12, 13, 14, 15] and item["targets"].tolist() == [13, 14, 15, 16]


def test_char_gpt_loss_at_init_is_uniform(char_gpt):
    vocab_size = 97
    model = _tiny(char_gpt, vocab_size)
    g = torch.Generator().manual_seed(0)
    batch = {"idx": torch.randint(0, vocab_size, (8, 16), generator=g),
             "targets": torch.randint(0, vocab_size, (8, 16), generator=g)}
    with torch.no_grad():
        out = model(batch)
        loss = model.loss(out, batch)
        metrics = model.metrics(out, batch)
    assert out.shape == (8, 16, vocab_size)
    assert abs(loss.item() - math.log(vocab_size)) < 0.1
    assert model.num_items(batch) == 8 * 16
    assert metrics["bits_per_char"].item() == pytest.approx(loss.item() / math.log(2), rel=1e-5)
    assert model.hparams == {"vocab_size": 97, "block_size": 16, "n_layer": 2, "n_head": 2,
                             "n_embd": 32, "dropout": 0.0}
    assert model.head.weight is model.tok_emb.weight  # tied


def test_char_gpt_generate_length(char_gpt):
    model = _tiny(char_gpt, 11, block_size=8)
    prompt = torch.tensor([1, 2, 3])
    out = model.generate(prompt, max_new_tokens=20, temperature=1.0, top_k=5,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (23,) and out[:3].tolist() == [1, 2, 3]
    assert int(out.min()) >= 0 and int(out.max()) < 11
    greedy = model.generate(prompt.expand(2, 3), max_new_tokens=5, temperature=0)
    assert greedy.shape == (2, 8) and model.training


def test_char_gpt_overfits_repeated_text(char_gpt, tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    vocab = char_gpt.CharVocab.build(text)
    data = char_gpt.CharWindows(vocab.encode(text), block_size=16, stride=8)
    model = _tiny(char_gpt, len(vocab))
    fitter = ll.Fitter(max_steps=40, batch_size=16, learning_rate=1e-2, lr_scheduler="constant",
                       log_every=1, loggers=[], save_strategy="no", model_summary=False,
                       progress_bar=False, output_dir=str(tmp_path / "run"), seed=0,
                       gradient_checkpointing=True)
    result = fitter.fit(model, data)
    losses = [e["train/loss"] for e in result.state.log_history if "train/loss" in e]
    assert losses[0] == pytest.approx(math.log(len(vocab)), abs=0.2)
    assert losses[-1] < 0.5 * losses[0], losses


def test_gan_example(tmp_path):
    """examples/gan.py (manual optimization), shortened: both losses logged, the evaluation's
    metrics reported without a loss(), the picture written to TensorBoard when it is installed."""
    out = tmp_path / "gan"
    proc = _run([str(EXAMPLES / "gan.py"), "--steps", "30", "--output-dir", str(out)], cwd=tmp_path)
    rows = (out / "logs" / "metrics.csv").read_text()
    assert "train/loss_d" in rows and "val/distance_to_mode" in rows and "val/loss" not in rows
    m = re.search(r"step 30: distance_to_mode (\S+), near_a_mode (\S+)", proc.stdout)
    assert m and math.isfinite(float(m.group(1))), proc.stdout
    if importlib.util.find_spec("tensorboard") is not None:
        events = b"".join(p.read_bytes() for p in (out / "logs").rglob("events.out.tfevents*"))
        assert b"samples/real_red_generated_green" in events
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "samples.png").is_file()

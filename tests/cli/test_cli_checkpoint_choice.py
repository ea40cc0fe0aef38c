"""``--checkpoint RUN_DIR`` picks the run's newest valid checkpoint; when the newest is damaged and
an older one is used, the output says which one and why the newer was skipped (driven through
``python -m lightlike.cli`` for real)."""

from __future__ import annotations

from test_cli import TARGET, cli

SMALL = ["--loggers", "[]", "--model_summary", "false", "--model.train_items", "32", "--model.val_items", "16",
         "--batch_size", "8"]


def test_validate_on_a_run_whose_newest_checkpoint_is_damaged_names_the_one_it_used(tmp_path):
    """checkpoint-4's weights get a flipped byte: `validate --checkpoint RUN` loads checkpoint-2
    (its metrics are those of `--checkpoint RUN/checkpoint-2`, not of checkpoint-4's weights) and
    stderr names checkpoint-2 as used and checkpoint-4 as skipped, with the reason."""
    run = tmp_path / "run"
    cli("fit", TARGET, "--max_steps", "4", "--save_every", "2", "--learning_rate", "0.1", "--output_dir", str(run),
        *SMALL)
    before, _ = cli("validate", TARGET, "--checkpoint", str(run), "--output_dir", str(tmp_path / "v0"), *SMALL)
    weights = run / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor
    weights.write_bytes(bytes(data))

    used, proc = cli("validate", TARGET, "--checkpoint", str(run), "--output_dir", str(tmp_path / "v1"), *SMALL)
    older, _ = cli("validate", TARGET, "--checkpoint", str(run / "checkpoint-2"), "--output_dir",
                   str(tmp_path / "v2"), *SMALL)
    assert used == older != before, (used, older, before)
    lines = [line for line in proc.stderr.splitlines() if "using checkpoint-2" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"lightlike: --checkpoint {run}: using checkpoint-2, the newest valid checkpoint; "
                               "skipped the newer checkpoint-4 (")
    assert "file model.safetensors has changed contents" in lines[0]

"""Defaults users expect of checkpoints and the best metric (issue 35): a fit with no save settings
keeps its trained model; ``metric_for_best`` named as the HF Trainer names it (``accuracy``,
``eval_loss``); ``load_best_at_end`` with evaluations between the saves (HF's eval every 500,
save every 1000). References: the module's own weights after the fit, weights recorded by a
callback at each step, the logged evaluations, and the Python API for the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lightlike as ll
from lightlike.best import resolve_key
from lightlike.checkpoint import list_checkpoints, verify_checkpoint
from lightlike.cli import main as cli_main
from tests.helpers import Classifier, DictDataset

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(loggers=[], model_summary=False, batch_size=4)


def same_weights(saved: dict[str, torch.Tensor], module: torch.nn.Module) -> bool:
    want = module.state_dict()
    return sorted(saved) == sorted(want) and all(torch.equal(saved[k], want[k]) for k in want)


# -- 1. a fit with no save settings keeps the trained model ----------------------------------------------
def test_a_fit_without_save_settings_keeps_its_final_weights_in_a_verified_checkpoint(tmp_path):
    """Default settings, no save_strategy/save_every: checkpoint-5 (the last step) is a full,
    verified, resumable checkpoint whose weights are the module's after the fit; FitResult names it."""
    out = tmp_path / "run"
    module = Classifier()
    result = ll.Fitter(max_steps=5, output_dir=str(out), **QUIET).fit(module, DictDataset(n=40))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-5"]
    assert result.last_checkpoint == str(out / "checkpoint-5")
    manifest = verify_checkpoint(out / "checkpoint-5", hashes=True)
    assert manifest["meta"]["kind"] == "full" and (out / "checkpoint-5" / "optimizer.pt").is_file()
    assert same_weights(load_file(str(out / "checkpoint-5" / "model.safetensors")), module)
    fresh = Classifier()
    fresh.load_weights(result.last_checkpoint)  # what a user loads, verified against the manifest
    assert same_weights(fresh.state_dict(), module)


def test_the_final_checkpoint_is_not_written_twice_and_save_strategy_no_writes_none(tmp_path):
    """The last step already saved on the schedule (save_every=3, 6 steps): no second save there;
    not on the schedule (4 steps): the end adds checkpoint-4. save_strategy='no': nothing at all."""
    saves = []

    class Saves(ll.Callback):
        def on_save(self, fitter, state, control, path):
            saves.append(Path(path).name)

    ll.Fitter(max_steps=6, save_every=3, output_dir=str(tmp_path / "a"), callbacks=[Saves()], **QUIET).fit(
        Classifier(), DictDataset(n=40))
    assert saves == ["checkpoint-3", "checkpoint-6"]
    ll.Fitter(max_steps=4, save_every=3, output_dir=str(tmp_path / "b"), **QUIET).fit(Classifier(), DictDataset(n=40))
    assert [p.name for p in list_checkpoints(tmp_path / "b")] == ["checkpoint-3", "checkpoint-4"]
    result = ll.Fitter(max_steps=3, save_strategy="no", output_dir=str(tmp_path / "c"), **QUIET).fit(
        Classifier(), DictDataset(n=40))
    assert result.last_checkpoint is None
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("checkpoint-*"))


def test_cli_fit_with_max_steps_only_keeps_the_model(capsys, tmp_path):
    """``lightlike fit mod.py:Net --max_steps 3``: the printed last_checkpoint holds the weights of
    the same fit through the Python API."""
    from examples.cli_module import Classifier as Example

    small = ["--loggers", "[]", "--model_summary", "false", "--model.train_items", "32", "--model.val_items", "16"]
    target = f"{ROOT / 'examples' / 'cli_module.py'}:Classifier"
    code = cli_main(["fit", target, "--max_steps", "3", "--output_dir", str(tmp_path / "cli"), *small])
    out, err = capsys.readouterr()
    assert code == 0, err
    printed = json.loads(out.strip().splitlines()[-1])
    assert printed["last_checkpoint"] == str(tmp_path / "cli" / "checkpoint-3")
    fitter = ll.Fitter(max_steps=3, loggers=[], model_summary=False, output_dir=str(tmp_path / "api"))
    with fitter.init_module():
        module = Example(train_items=32, val_items=16)
    fitter.fit(module, module.train_data(), module.val_data())
    assert same_weights(load_file(str(Path(printed["last_checkpoint"]) / "model.safetensors")), module)


# -- 2. metric_for_best as the HF Trainer names it -------------------------------------------------------
def test_a_name_alone_resolves_to_the_one_evaluation_metric_of_that_name():
    names = ["val/accuracy", "val/loss"]
    assert resolve_key("accuracy", names) == "val/accuracy"
    assert resolve_key("eval_accuracy", names) == "val/accuracy"  # the HF Trainer's spelling
    assert resolve_key("eval_loss", names) == "val/loss"
    assert resolve_key("val_loss", names) == "val/loss"  # Lightning's
    assert resolve_key("val/loss", names) == "val/loss"
    with pytest.raises(ll.ConfigError, match=r"'accuracy' matches several evaluation metrics "
                                             r"\['test/accuracy', 'val/accuracy'\]: set metric_for_best to one"):
        resolve_key("accuracy", ["test/accuracy", "test/loss", *names])
    with pytest.raises(ll.ConfigError, match=r"'acuracy' is not among the evaluation metrics .*'val/accuracy'"):
        resolve_key("acuracy", names)


class Scored(Classifier):
    """Its evaluation metric ``score`` is set per step by ``SCORES``, so the best step is known."""

    SCORES: dict[int, float] = {}
    step = 0

    def metrics(self, outputs, batch):
        return {"score": torch.tensor(float(self.SCORES[type(self).step]))}


class Record(ll.Callback):
    """The module's weights at every step's end (the reference for the best step's weights)."""

    def __init__(self):
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, fitter, state, control):
        type(fitter.module).step = state.global_step
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in fitter.module.state_dict().items()}


def test_hf_spellings_of_metric_for_best_follow_the_logged_evaluations(tmp_path):
    """``eval_loss`` (lower is better, from the name) picks the step of the lowest logged val/loss;
    ``score`` alone (higher, from the name) the highest val/score."""
    result = ll.Fitter(max_steps=8, eval_every=2, metric_for_best="eval_loss", output_dir=str(tmp_path / "a"),
                       learning_rate=0.05, **QUIET).fit(Classifier(), DictDataset(n=40), DictDataset(n=8))
    evaluated = [(row["val/loss"], row["step"]) for row in result.state.log_history if "val/loss" in row]
    assert len(evaluated) == 4 and (result.state.best_metric, result.state.best_step) == min(evaluated)

    class M(Scored):
        SCORES = {2: 1.0, 4: 3.0, 6: 2.0}

    result = ll.Fitter(max_steps=6, eval_every=2, metric_for_best="score", output_dir=str(tmp_path / "b"),
                       callbacks=[Record()], **QUIET).fit(M(), DictDataset(n=40), DictDataset(n=8))
    assert (result.state.best_metric, result.state.best_step) == (3.0, 4)


def test_an_ambiguous_name_is_one_error_after_the_steps_checkpoint(tmp_path):
    """Two evaluation sets both give ``accuracy``: one ConfigError naming both, raised after the
    first evaluation's step is saved (save_every=2), so no training is lost."""
    with pytest.raises(ll.ConfigError, match=r"metric_for_best='accuracy' matches several evaluation metrics "
                                             r"\['a/accuracy', 'b/accuracy'\].*found at the evaluation of step 2; "
                                             r"checkpoint-2 was saved first"):
        ll.Fitter(max_steps=6, eval_every=2, save_every=2, metric_for_best="accuracy", output_dir=str(tmp_path),
                  **QUIET).fit(Classifier(), DictDataset(n=40), {"a": DictDataset(n=8), "b": DictDataset(n=8, seed=1)})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]


# -- 3. load_best_at_end with evaluations between the saves ----------------------------------------------
def test_load_best_at_end_loads_a_best_that_falls_between_the_saves(tmp_path):
    """eval_every=2, save_every=4 (HF's 500/1000), best at step 6 (no scheduled save there), and
    save_total_limit=1: the evaluation that improved was saved, rotation kept it, and the module
    ends with the weights it had at step 6."""
    class M(Scored):
        SCORES = {2: 1.0, 4: 5.0, 6: 10.0, 8: 2.0, 10: 0.0}

    record = Record()
    fitter = ll.Fitter(max_steps=10, eval_every=2, save_every=4, save_total_limit=1, metric_for_best="val/score",
                       load_best_at_end=True, output_dir=str(tmp_path), callbacks=[record], **QUIET)
    module = M()
    result = fitter.fit(module, DictDataset(n=40), DictDataset(n=8))
    assert result.state.best_step == 6 and result.best_checkpoint == str(tmp_path / "checkpoint-6")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-10"]
    assert result.last_checkpoint == str(tmp_path / "checkpoint-10")
    assert not same_weights(record.weights[10], module)  # the final weights differ from the best's
    assert same_weights(record.weights[6], module)
    assert same_weights(load_file(str(tmp_path / "checkpoint-10" / "model.safetensors")),
                        _as_module(record.weights[10]))


def _as_module(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = Classifier()
    module.load_state_dict(weights)
    return module

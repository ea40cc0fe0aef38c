"""resuming and load_best_at_end (lightlike/checkpoint/training.py)."""
import json

import pytest
import torch
from helpers import Classifier, DictDataset
from safetensors.torch import load_file

import lightlike as ll
from lightlike.errors import CheckpointError


class OwnOptimizer(Classifier):
    """configure_optimizers of its own: AdamW, and a LambdaLR only when ``with_schedule``."""
    with_schedule = False

    def configure_optimizers(self, config=None):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if not type(self).with_schedule:
            return opt
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)


def test_resume_with_a_scheduler_from_a_checkpoint_without_one_is_a_checkpoint_error(tmp_path):
    """A checkpoint without scheduler.pt (a run without an LR scheduler: before every optimizer
    got the configured schedule, or one whose file went missing); a run that has one cannot
    restore it: a CheckpointError names the file (not a bare FileNotFoundError)."""
    out = str(tmp_path / "run")
    torch.manual_seed(0)
    ll.Fitter(max_steps=2, batch_size=4, save_every=2, output_dir=out, loggers=[]).fit(OwnOptimizer(), DictDataset(n=16))
    ckpt = tmp_path / "run" / "checkpoint-2"
    (ckpt / "scheduler.pt").unlink()  # and out of the manifest: a checkpoint written without one
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["scheduler.pt"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    class WithSchedule(OwnOptimizer):
        with_schedule = True

    with pytest.raises(CheckpointError, match=r"checkpoint-2 has no scheduler\.pt but this run has a scheduler"):
        ll.Fitter(max_steps=4, batch_size=4, save_every=2, output_dir=out, loggers=[]).fit(
            WithSchedule(), DictDataset(n=16), resume=True)


def test_load_best_at_end_verifies_the_best_checkpoint_before_loading_it(tmp_path):
    """The best checkpoint (step 2) gets a same-size bit flip in its weights after it was written;
    load_best_at_end must refuse it (checksums, verify_hashes=True) rather than load the damaged
    weights into the module."""
    class FirstIsBest(Classifier):
        evals = 0

        def metrics(self, outputs, batch):
            return {"score": torch.tensor(-float(type(self).evals))}

    class Damage(ll.Callback):
        def on_evaluate(self, fitter, state, control, metrics):
            type(fitter.module).evals += 1

        def on_save(self, fitter, state, control, path):
            if state.global_step == 4:  # checkpoint-2 is the best; flip its last tensor byte
                f = tmp_path / "run" / "checkpoint-2" / "model.safetensors"
                data = bytearray(f.read_bytes())
                data[-1] ^= 0x40
                f.write_bytes(bytes(data))

    torch.manual_seed(0)
    model = FirstIsBest()
    fitter = ll.Fitter(max_steps=4, batch_size=4, save_every=2, eval_every=2, metric_for_best="val/score",
                       greater_is_better=True, load_best_at_end=True, output_dir=str(tmp_path / "run"),
                       loggers=[], callbacks=[Damage()])
    with pytest.raises(CheckpointError, match="checkpoint-2"):
        fitter.fit(model, DictDataset(n=16), DictDataset(n=8))
    damaged = load_file(str(tmp_path / "run" / "checkpoint-2" / "model.safetensors"))
    assert not all(torch.equal(damaged[k], v) for k, v in model.state_dict().items())


def test_a_seal_that_fails_after_the_fit_failed_does_not_hide_the_fit_s_error(tmp_path, monkeypatch, caplog):
    """async_save: checkpoint-6 is being sealed when step 7 raises; the seal fails too. The fit's
    own error comes out (the seal's is logged) and nothing is published."""
    from lightlike.checkpoint.atomic import CheckpointWriter
    from lightlike.checkpoint.manifest import list_checkpoints

    seal = CheckpointWriter.seal

    def failing_seal(self):
        if self.final_path.name == "checkpoint-6":
            raise OSError("disk gone while sealing")
        return seal(self)

    monkeypatch.setattr(CheckpointWriter, "seal", failing_seal)
    seen = []

    class FailAt7(ll.Callback):
        def on_step_start(self, fitter, state, control):
            if state.global_step == 6:
                raise RuntimeError("boom at step 7")

        def on_exception(self, fitter, state, control, error):
            seen.append(error)

    out = tmp_path / "run"
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="boom at step 7"):
        ll.Fitter(max_steps=9, batch_size=4, save_every=3, async_save=True, output_dir=str(out), loggers=[],
                  callbacks=[FailAt7()]).fit(Classifier(), DictDataset(n=40))
    assert [str(e) for e in seen] == ["boom at step 7"]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]
    assert "could not be committed: disk gone while sealing" in caplog.text


def test_a_resume_past_the_runs_end_is_refused_and_one_at_its_end_ends_at_once(tmp_path, caplog):
    """Resuming a 3-epoch run's last checkpoint with max_epochs=1 (or max_steps below its step)
    warned about the changed setting and returned having trained nothing. Lightning refuses it;
    so does lightlike, before anything is built, naming the setting. The same max_epochs (a
    finished run, requeued) resumes and ends at once, saying so."""
    import logging

    import torch
    from helpers import Classifier, DictDataset

    import lightlike as ll

    out = str(tmp_path / "run")
    cfg = dict(batch_size=4, output_dir=out, loggers=[], model_summary=False)
    torch.manual_seed(0)
    ll.Fitter(max_epochs=3, save_strategy="epoch", **cfg).fit(Classifier(), DictDataset(n=16))
    for setting, says in (({"max_epochs": 1}, "with max_epochs=1: the checkpoint is past this run's end "
                                              "\\(epoch 1\\), so nothing would train. Set max_epochs above 3"),
                          ({"max_steps": 10}, "with max_steps=10: .* Set max_steps above 12")):
        with pytest.raises(ll.ConfigError, match=r"resume from checkpoint-12 \(step 12, epoch 3\) " + says):
            ll.Fitter(**setting, **cfg).fit(Classifier(), DictDataset(n=16), resume=True)
    with caplog.at_level(logging.INFO, logger="lightlike"):
        result = ll.Fitter(max_epochs=3, **cfg).fit(Classifier(), DictDataset(n=16), resume=True)
    assert result.global_step == 12
    assert "checkpoint-12 is at this run's last step (12): nothing is left to train" in caplog.text


def test_a_renamed_checkpoint_folder_resumed_from_is_not_set_aside_as_newer_than_itself(tmp_path):
    """checkpoint-4 renamed checkpoint-9 and resumed from by path: the resume set the folder it
    had just loaded aside as "older than checkpoint-9". It stays where it is; the run goes on
    from step 4 to the end."""
    import torch
    from helpers import Classifier, DictDataset

    import lightlike as ll

    out = tmp_path / "run"
    cfg = dict(batch_size=4, output_dir=str(out), loggers=[], model_summary=False, save_every=4)
    torch.manual_seed(0)
    ll.Fitter(max_steps=4, **cfg).fit(Classifier(), DictDataset(n=40))
    (out / "checkpoint-4").rename(out / "checkpoint-9")
    result = ll.Fitter(max_steps=8, **cfg).fit(Classifier(), DictDataset(n=40), resume=str(out / "checkpoint-9"))
    assert result.global_step == 8
    assert (out / "checkpoint-9" / "manifest.json").is_file()
    assert not list(out.glob("abandoned-*"))

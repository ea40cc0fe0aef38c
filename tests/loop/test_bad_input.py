"""Bad input: one clear error naming what to change; nothing already written is lost."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import Classifier, DictDataset
from torch import nn

import lightlike as ll
from lightlike.config import OTHER_NAMES


def fitter(tmp_path, **kw):
    cfg = dict(max_steps=2, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[], model_summary=False)
    cfg.update(kw)
    return ll.Fitter(**cfg)


def test_unknown_strategy_lists_valid_names(tmp_path):
    with pytest.raises(ll.ConfigError, match=r"unknown strategy 'singel' \(did you mean 'single'\?\).*auto, single"):
        fitter(tmp_path, strategy="singel").fit(Classifier(), DictDataset())


def test_unknown_precision_lists_valid_names(tmp_path):
    with pytest.raises(ll.ConfigError, match=r"unknown precision 'bf16-mix'.*bf16-mixed.*32-true"):
        fitter(tmp_path, precision="bf16-mix").fit(Classifier(), DictDataset())


def test_unknown_keyword_names_closest():
    with pytest.raises(ll.ConfigError, match=r"'max_step' \(did you mean 'max_steps'"):
        ll.Fitter(max_step=10)
    with pytest.raises(ll.ConfigError, match=r"'learning_rte' \(did you mean 'learning_rate'"):
        ll.FitConfig.from_dict({"max_steps": 1, "learning_rte": 0.1})


@pytest.mark.parametrize("name, hint", [("lr", "'learning_rate'"), ("eval_steps", "'eval_every'"),
                                        ("num_train_epochs", "'max_epochs'"), ("fp16", "precision='16-mixed'"),
                                        ("gradient_accumulation_steps", "'grad_accum_steps'")])
def test_hf_and_lightning_names_point_at_the_field(name, hint):
    """A migrating user's key gets the field it maps to (docs/migrating.md), not a look-alike
    ('lr' used to suggest 'lr_end')."""
    with pytest.raises(ll.ConfigError, match=rf"'{name}' \(did you mean {re.escape(hint)}\?\)"):
        ll.Fitter(**{name: 1})
    assert all(v.split("=")[0].split(" ")[0] in ll.FitConfig.__dataclass_fields__ or v.startswith("fit(")
               or v.startswith("!") for v in OTHER_NAMES.values())  # "!": no setting of its own


def test_unknown_keyword_to_fit_config_itself_names_closest():
    with pytest.raises(ll.ConfigError, match=r"'max_step' \(did you mean 'max_steps'"):
        ll.FitConfig(max_step=1)
    with pytest.raises(ll.ConfigError, match=r"'learning_rte' \(did you mean 'learning_rate'"):
        ll.FitConfig(max_steps=1).replace(learning_rte=0.1)


@pytest.mark.parametrize("field,value,message", [
    ("learning_rate", "3e-4", r"learning_rate='3e-4' \(str\) is not valid: learning_rate takes a number.*"
                              r"write learning_rate=0.0003, not the string '3e-4'"),
    ("warmup_ratio", "0.1", r"warmup_ratio='0.1' \(str\).*takes a number.*write warmup_ratio=0.1"),
    ("max_grad_norm", "1.0", r"max_grad_norm='1.0' \(str\).*takes a number \(int or float\) or None.*"
                             r"max_grad_norm=1.0"),
    ("warmup_ratio", None, r"warmup_ratio=None \(NoneType\).*takes a number.*leave warmup_ratio out for its "
                           r"default \(0.0\)"),
    ("batch_size", True, r"batch_size=True \(bool\) is not valid: batch_size takes an int; True is a bool"),
    ("batch_size", 32.0, r"batch_size=32.0 \(float\).*takes an int; write batch_size=32"),
    ("shuffle", "false", r"shuffle='false' \(str\).*takes True or False; write shuffle=False"),
    ("output_dir", None, r"output_dir=None.*takes a string"),
    ("log_level", "loud", r"log_level='loud' is not valid; choose one of: debug, info"),
    ("adam_beta2", 1.0, r"adam_beta2 must be in \[0, 1\), got 1.0"),
    ("learning_rate", float("nan"), r"learning_rate must be finite, got nan"),
    ("max_grad_norm", 0, r"max_grad_norm must be a finite number > 0 or None, got 0"),
    ("max_grad_norm", 0.0, r"max_grad_norm must be a finite number > 0 or None, got 0.0"),
    ("max_grad_value", 0, r"max_grad_value must be a finite number > 0 or None, got 0"),
    ("max_grad_value", -1.0, r"max_grad_value must be a finite number > 0 or None, got -1.0"),
    ("momentum", -0.1, r"momentum must be >= 0, got -0.1"),
    ("num_workers", -1, r"num_workers must be >= 0, got -1"),
    ("max_steps", 0, r"max_steps must be a positive int, got 0"),
    ("max_epochs", 0, r"max_epochs must be a number of epochs > 0 \(2 or 2.5\), got 0"),
    ("warmup_ratio", 1.0, r"warmup_ratio must be in \[0, 1\), got 1.0"),
    ("warmup_ratio", -0.1, r"warmup_ratio must be in \[0, 1\), got -0.1"),
])
def test_wrong_type_or_value_is_one_config_error(field, value, message):
    with pytest.raises(ll.ConfigError, match=message):
        ll.FitConfig(**{"max_steps": 1, field: value})


def test_null_in_a_config_file_names_the_field():
    with pytest.raises(ll.ConfigError, match=r"warmup_ratio=None.*leave warmup_ratio out"):
        ll.FitConfig.from_json('{"max_steps": 1, "warmup_ratio": null}')


def test_accepted_forms_still_work(tmp_path):
    cfg = ll.FitConfig(max_steps=1, learning_rate=1, max_grad_norm=2, output_dir=tmp_path, log_level="INFO")
    assert cfg.output_dir == str(tmp_path) and cfg.learning_rate == 1
    assert ll.FitConfig.from_json(cfg.to_json()) == cfg
    import numpy as np  # numbers from a numpy sweep become Python numbers (and JSON-serialisable)

    cfg = ll.FitConfig(max_steps=np.int64(3), seed=np.int32(1), learning_rate=np.float32(0.5), shuffle=np.bool_(False))
    assert (cfg.max_steps, cfg.seed, cfg.learning_rate, cfg.shuffle) == (3, 1, 0.5, False)
    assert type(cfg.max_steps) is int and type(cfg.learning_rate) is float and type(cfg.shuffle) is bool
    assert ll.FitConfig.from_json(cfg.to_json()) == cfg


BEST = dict(max_steps=10, metric_for_best="val/loss", load_best_at_end=True)


def test_load_best_at_end_refuses_only_save_strategy_no():
    """Every evaluation that improves metric_for_best is saved with load_best_at_end, so only
    save_strategy='no' (no checkpoint at all) has no best to load."""
    with pytest.raises(ll.ConfigError, match=r"save_strategy='no' saves no checkpoint to load") as e:
        ll.FitConfig(**BEST, save_strategy="no", eval_every=2)
    assert set(e.value.settings) == {"load_best_at_end", "save_strategy"}


@pytest.mark.parametrize("kw", [dict(save_every=2, eval_every=2), dict(save_every=2, eval_every=4),
                                dict(save_every=4, eval_every=2), dict(save_every=3, eval_every=2),
                                dict(eval_every=2), dict(save_every=2, eval_every=2, eval_on_epoch_end=True),
                                dict(save_strategy="epoch"), dict(save_strategy="epoch", eval_on_epoch_end=True),
                                dict(save_strategy="epoch", eval_on_epoch_end=True, eval_every=5),
                                dict(save_strategy="best", eval_every=3)])
def test_load_best_at_end_consistent_settings(kw):
    """Evaluations between the saves (the HF Trainer's eval every 500, save every 1000) included."""
    ll.FitConfig(**BEST, **kw)


@pytest.mark.parametrize("kw", [dict(load_best_at_end=True, save_every=2, eval_every=2),
                                dict(load_best_at_end=True, save_strategy="best", eval_every=2),
                                dict(save_strategy="best", eval_every=2)])
def test_best_checkpoints_need_metric_for_best(kw):
    with pytest.raises(ll.ConfigError, match=r"save_strategy='best' and load_best_at_end need metric_for_best") as e:
        ll.FitConfig(max_steps=10, **kw)
    assert "metric_for_best" in e.value.settings
    ll.FitConfig(max_steps=10, metric_for_best="val/loss", **kw)  # with it, the same settings are fine


def test_no_stopping_criterion(tmp_path):
    """fit() needs max_steps or max_epochs, and says so before any set-up; evaluating alone does
    not (a Fitter built only to validate or predict, as with the HF Trainer's evaluate())."""
    fitter = ll.Fitter(batch_size=4, output_dir=str(tmp_path / "run"), loggers=[])
    with pytest.raises(ll.ConfigError, match="no stopping criterion: set max_steps=N or max_epochs=N") as e:
        fitter.fit(Classifier(), DictDataset())
    assert set(e.value.settings) == {"max_steps", "max_epochs"}
    assert not (tmp_path / "run").exists()  # nothing was set up
    module, data = Classifier(), DictDataset(n=16)
    metrics = fitter.validate(module, data)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(module.net(data.x), data.y).item()
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-6)


def test_iterable_data_with_max_epochs_only(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(DictDataset()[i] for i in range(8))

    cfg = dict(output_dir=str(tmp_path), batch_size=4, max_epochs=1, loggers=[], progress_bar=False)
    with pytest.raises(ll.ConfigError, match=r"no length \(IterableDataset\): set max_steps"):
        ll.Fitter(**cfg).fit(Classifier(), Stream())


def test_empty_dataset(tmp_path):
    with pytest.raises(ll.DataError, match="training data is empty"):
        fitter(tmp_path).fit(Classifier(), DictDataset(n=0))
    with pytest.raises(ll.DataError, match="val data is empty"):
        fitter(tmp_path, overwrite_output_dir=True).fit(Classifier(), DictDataset(), DictDataset(n=0))


def test_missing_batch_key(tmp_path):
    class ReadsZ(Classifier):
        def forward(self, batch):
            return self.net(batch["z"])

    with pytest.raises(ll.DataError, match=r"batch key 'z'.*step 1, micro-batch 0.*\['w', 'x', 'y'\]"):
        fitter(tmp_path).fit(ReadsZ(), DictDataset())


def test_loss_not_scalar(tmp_path):
    class PerItemLoss(Classifier):
        def loss(self, outputs, batch):
            return nn.functional.cross_entropy(outputs, batch["y"], reduction="none")

    with pytest.raises(ll.ModuleContractError, match=r"shape \(4,\).*return a scalar"):
        fitter(tmp_path).fit(PerItemLoss(), DictDataset())

    class FloatLoss(Classifier):
        def loss(self, outputs, batch):
            return 1.0

    with pytest.raises(ll.ModuleContractError, match="loss\\(\\) returned float"):
        fitter(tmp_path).fit(FloatLoss(), DictDataset())


def test_metrics_not_scalar(tmp_path):
    class VectorMetric(Classifier):
        def metrics(self, outputs, batch):
            return {"per_item": outputs.argmax(-1).float()}

    with pytest.raises(ll.ModuleContractError, match=r"metrics\(\)\['per_item'\].*shape \(4,\)"):
        fitter(tmp_path).validate(VectorMetric(), DictDataset(n=8))


def test_metrics_may_be_numpy_scalars(tmp_path):
    """A metric computed with numpy (np.float32, np.int64) is a number like a float (it was
    refused: "is a float32; return a scalar"); a string is still refused by name."""
    import numpy as np

    class NumpyMetric(Classifier):
        def metrics(self, outputs, batch):
            right = (outputs.argmax(-1) == batch["y"]).numpy()
            return {"accuracy": np.float32(right.mean()), "right": np.int64(right.sum())}

    data, module = DictDataset(n=8), NumpyMetric()
    metrics = fitter(tmp_path).validate(module, data)
    with torch.no_grad():
        accuracy = (module.net(data.x).argmax(-1) == data.y).double().mean().item()
    assert set(metrics) == {"val/loss", "val/accuracy", "val/right"}
    assert metrics["val/accuracy"] == pytest.approx(accuracy, abs=1e-7)

    class TextMetric(Classifier):
        def metrics(self, outputs, batch):
            return {"label": "good"}

    with pytest.raises(ll.ModuleContractError, match=r"metrics\(\)\['label'\] is a str"):
        fitter(tmp_path).validate(TextMetric(), data)


def test_eval_every_without_eval_data(tmp_path):
    with pytest.raises(ll.ConfigError, match="eval_every is set but fit\\(\\) got no evaluation data"):
        fitter(tmp_path, eval_every=1).fit(Classifier(), DictDataset())


def test_device_that_does_not_exist(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ll.ConfigError, match="CUDA is not available here"):
        fitter(tmp_path, accelerator="cuda").fit(Classifier(), DictDataset())


def test_single_strategy_under_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ll.ConfigError, match="strategy='single' but WORLD_SIZE=4"):
        fitter(tmp_path, strategy="single").fit(Classifier(), DictDataset())


def test_not_a_task_module(tmp_path):
    with pytest.raises(ll.ModuleContractError, match="subclass ll.TaskModule"):
        fitter(tmp_path).fit(nn.Linear(2, 2), DictDataset())


def test_output_dir_not_overwritten(tmp_path):
    fitter(tmp_path, save_every=2).fit(Classifier(), DictDataset())
    ckpt = tmp_path / "run" / "checkpoint-2"
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(ll.OutputDirError, match="already holds a run.*resume=True.*overwrite_output_dir=True"):
        fitter(tmp_path, save_every=2).fit(Classifier(), DictDataset())
    assert sorted(p.name for p in ckpt.iterdir()) == before
    # asked for: replaced
    fitter(tmp_path, save_every=1, overwrite_output_dir=True).fit(Classifier(), DictDataset())
    assert (tmp_path / "run" / "checkpoint-1").is_dir()


def test_output_dir_without_a_resumable_checkpoint_does_not_suggest_resume(tmp_path):
    """Logs only (no save): resume=True would fail, so the error must not send the user there."""
    fitter(tmp_path, loggers=["csv"], save_strategy="no").fit(Classifier(), DictDataset())
    with pytest.raises(ll.OutputDirError, match="already holds a run") as caught:
        fitter(tmp_path).fit(Classifier(), DictDataset())
    assert "resume=True" not in str(caught.value) and "resume='auto'" in str(caught.value)
    ll.Fitter(max_steps=2, batch_size=4, output_dir=str(tmp_path / "run"), loggers=[],
              model_summary=False).fit(Classifier(), DictDataset(), resume="auto")  # the advice works


def test_a_missing_key_is_blamed_on_who_read_it_and_a_modules_own_key_error_passes_through(tmp_path):
    class LossReadsZ(Classifier):
        def loss(self, outputs, batch):
            return nn.functional.cross_entropy(outputs, batch["z"])

    with pytest.raises(ll.DataError, match=r"^loss\(\) read batch key 'z' at step 1, micro-batch 0"):
        fitter(tmp_path).fit(LossReadsZ(), DictDataset())

    class OwnTable(Classifier):  # a KeyError of the module's own dict: not the batch's fault
        def forward(self, batch):
            return self.net(batch["x"]) * {"scale": 1.0}["missing"]

    with pytest.raises(KeyError, match="missing") as caught:
        fitter(tmp_path, overwrite_output_dir=True).fit(OwnTable(), DictDataset())
    assert not isinstance(caught.value, ll.DataError)


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "run").write_text("notes")
    with pytest.raises(ll.OutputDirError, match="is a file, not a directory: choose another output_dir"):
        fitter(tmp_path).fit(Classifier(), DictDataset())
    assert (tmp_path / "run").read_text() == "notes"


def test_eval_on_epoch_end_without_eval_data(tmp_path):
    with pytest.raises(ll.ConfigError, match="eval_on_epoch_end is set but fit\\(\\) got no evaluation data"):
        fitter(tmp_path, max_steps=None, max_epochs=1, eval_on_epoch_end=True).fit(Classifier(), DictDataset())


def test_tuple_batch_read_by_key(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randint(0, 3, (8,)))
    with pytest.raises(ll.DataError, match="the module read the batch by key at step 1, micro-batch 0, but the "
                                           "batch is a list of 2 elements, not a mapping"):
        fitter(tmp_path).fit(Classifier(), data)

    class ByPosition(Classifier):  # a forward that gets it right, a loss that does not
        def forward(self, batch):
            return self.net(batch[0])

    with pytest.raises(ll.DataError, match="loss\\(\\) read the batch by key at step 1"):
        fitter(tmp_path).fit(ByPosition(), data)


def test_loss_that_does_not_require_grad(tmp_path):
    class Detached(Classifier):
        def loss(self, outputs, batch):
            return super().loss(outputs, batch).detach()

    with pytest.raises(ll.ModuleContractError, match="loss\\(\\) returned a tensor that does not require grad "
                                                     "at step 1, micro-batch 0"):
        fitter(tmp_path).fit(Detached(), DictDataset())


def test_nonfinite_loss_raises_naming_step_and_micro_batch(tmp_path):
    class NaNAtSecondStep(Classifier):
        calls = 0

        def loss(self, outputs, batch):
            type(self).calls += 1
            loss = super().loss(outputs, batch)
            return loss * float("nan") if type(self).calls == 4 else loss  # step 2, micro-batch 1

    with pytest.raises(ll.NonFiniteLossError, match="optimizer step 2, micro-batch 1"):
        fitter(tmp_path, max_steps=5, grad_accum_steps=2).fit(NaNAtSecondStep(), DictDataset(n=40))


def test_nonfinite_skip_policy_counts(tmp_path):
    class NaNAtSecondStep(Classifier):
        calls = 0

        def loss(self, outputs, batch):
            type(self).calls += 1
            loss = super().loss(outputs, batch)
            return loss * float("nan") if type(self).calls == 2 else loss

    model = NaNAtSecondStep()
    result = fitter(tmp_path, max_steps=4, nonfinite_loss="skip", log_every=1).fit(model, DictDataset(n=40))
    assert result.skipped_steps == 1 and result.global_step == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    logged = [h for h in result.state.log_history if "train/skipped_steps" in h]
    assert logged and logged[-1]["train/skipped_steps"] == 1.0


@pytest.mark.parametrize("log_every", [1, 3])
def test_a_skipped_step_logs_no_gradient_norm(tmp_path, log_every):
    """With max_grad_norm, the row of a step skipped for a NaN loss carried the previous step's
    norm when log_every > 1 (and none with log_every=1; a resumed run none either): it has none,
    and every other row carries its own step's norm (seen in on_before_optimizer_step: a
    max_grad_norm that clips nothing)."""
    class NaNAtStep3(Classifier):
        calls = 0

        def loss(self, outputs, batch):
            type(self).calls += 1
            loss = super().loss(outputs, batch)
            return loss * float("nan") if type(self).calls == 3 else loss

    class Norms(ll.Callback):
        seen: dict = {}

        def on_before_optimizer_step(self, fitter, state, control, optimizer):
            grads = [p.grad for p in fitter.module.parameters() if p.grad is not None]
            Norms.seen[state.global_step + 1] = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads])))

    result = fitter(tmp_path, max_steps=6, nonfinite_loss="skip", log_every=log_every, max_grad_norm=100.0,
                    callbacks=[Norms()]).fit(NaNAtStep3(), DictDataset(n=40))
    rows = {h["step"]: h for h in result.state.log_history if "train/loss" in h}
    assert "train/grad_norm" not in rows[3]
    for step in rows.keys() - {3}:
        assert rows[step]["train/grad_norm"] == pytest.approx(Norms.seen[step], rel=1e-5), step


def test_a_skipped_step_leaves_the_buffers_as_they_were(tmp_path):
    """A NaN item at step 2 reaches BatchNorm's running statistics in the forward pass, before the
    loss is seen; the skipped step puts them back (they were NaN for good, and every evaluation
    after it with them). Reference: the same run with step 2's batch left out entirely."""

    class Normed(Classifier):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(8)

        def forward(self, batch):
            return self.net(self.norm(batch["x"]))

    class Without(torch.utils.data.Dataset):  # in order, so step 2 is items 4..7
        def __init__(self, drop):
            self.data, self.keep = DictDataset(n=20), [i for i in range(20) if not (drop and 4 <= i < 8)]

        def __len__(self):
            return len(self.keep)

        def __getitem__(self, i):
            item = dict(self.data[self.keep[i]])
            if self.keep[i] == 5 and not drop_nan[0]:
                item["x"] = torch.full_like(item["x"], float("nan"))
            return item

    def go(drop, steps):
        drop_nan[0] = drop
        torch.manual_seed(0)
        model = Normed()
        result = fitter(tmp_path / str(drop), max_steps=steps, nonfinite_loss="skip", shuffle=False,
                                lr_scheduler="constant").fit(
            model, Without(drop))
        return model, result

    drop_nan = [False]
    skipped, result = go(False, 4)
    reference, _ = go(True, 3)
    assert result.skipped_steps == 1
    assert torch.isfinite(skipped.norm.running_mean).all() and torch.isfinite(skipped.norm.running_var).all()
    for name, value in reference.state_dict().items():
        assert torch.equal(skipped.state_dict()[name], value), name


def test_config_round_trip(tmp_path):
    cfg = ll.FitConfig(max_steps=7, learning_rate=0.5, loggers=["csv"], max_grad_norm=1.0)
    assert ll.FitConfig.from_json(cfg.to_json()) == cfg
    assert ll.FitConfig.from_toml(cfg.to_toml()) == cfg
    path = tmp_path / "c.toml"
    cfg.to_toml(path)
    assert ll.FitConfig.from_toml(path) == cfg
    # characters outside the BMP (JSON's \ud83d escapes are not TOML), and a None that TOML cannot
    # hold where the default is not None (it read back as 'auto'): one clear error, not a silent change
    emoji = ll.FitConfig(max_steps=1, output_dir="runs/\U0001f680")
    assert ll.FitConfig.from_toml(emoji.to_toml()) == emoji
    with pytest.raises(ll.ConfigError, match=r"loggers=None cannot be written as TOML.*default 'auto'.*JSON or YAML"):
        ll.FitConfig(max_steps=1, loggers=None).to_toml()
    with pytest.raises(ll.ConfigError, match="lr_scheduler='cosin' is not valid \\(did you mean 'cosine'"):
        ll.FitConfig(max_steps=1, lr_scheduler="cosin")

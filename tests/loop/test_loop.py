"""The loop's bookkeeping at step and epoch boundaries: callback flags at an epoch's end, epoch
limits, the data position across a change of batch size, logs that a resumed run does not
repeat, out-of-memory retries, and the figures the state keeps."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params
from torch.utils.data import DataLoader

import lightlike as ll
from lightlike.errors import DataError, NonFiniteLossError


class Recorder(ll.Callback):
    """Records epoch starts, evaluations and saves; optionally sets flags."""

    def __init__(self, at_epoch_end: tuple[str, ...] = (), stop_epoch_at: int | None = None):
        self.at_epoch_end, self.stop_epoch_at = at_epoch_end, stop_epoch_at
        self.epochs: list[int] = []
        self.evals: list[int] = []
        self.saves: list[int] = []

    def on_epoch_start(self, fitter, state, control):
        self.epochs.append(state.epoch_index)

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.stop_epoch_at:
            control.should_epoch_stop = True

    def on_epoch_end(self, fitter, state, control):
        for flag in self.at_epoch_end:
            setattr(control, flag, True)

    def on_evaluate(self, fitter, state, control, metrics):
        self.evals.append(state.global_step)

    def on_save(self, fitter, state, control, path):
        self.saves.append(state.global_step)


def test_flags_set_at_an_epoch_end_act_at_that_step(tmp_path):
    rec = Recorder(at_epoch_end=("should_save", "should_evaluate"))
    ll.Fitter(max_epochs=2, batch_size=4, output_dir=str(tmp_path), loggers=[], callbacks=[rec]).fit(
        Classifier(), DictDataset(n=12), DictDataset(n=8))
    assert rec.saves == [3, 6]
    assert rec.evals == [3, 6]  # the final evaluation is not repeated at step 6
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]


def test_an_epoch_stopped_early_counts_towards_max_epochs(tmp_path):
    rec = Recorder(stop_epoch_at=1)
    result = ll.Fitter(max_epochs=2, batch_size=4, output_dir=str(tmp_path), loggers=[], callbacks=[rec]).fit(
        Classifier(), DictDataset(n=12))
    assert rec.epochs == [0, 1]  # HF and Lightning: epoch 0 cut short, epoch 1 whole, then stop
    assert result.global_step == 1 + 3
    assert result.state.epoch == 2.0


class IndexLog(DictDataset):
    """Records every index it serves (num_workers=0: in this process)."""

    def __init__(self, n: int):
        super().__init__(n=n)
        self.served: list[int] = []

    def __getitem__(self, i):
        self.served.append(int(i))
        return super().__getitem__(i)


@pytest.mark.parametrize("new_batch", [8, 3])
def test_resume_with_another_batch_size_continues_on_the_right_sample(tmp_path, new_batch):
    out = str(tmp_path)
    data = IndexLog(40)
    ll.Fitter(max_steps=2, batch_size=4, save_every=2, output_dir=out, loggers=[], seed=3).fit(Classifier(), data)
    first = list(data.served)
    assert len(first) == 8
    data.served.clear()
    steps = -(-32 // new_batch)  # to the end of the epoch
    ll.Fitter(max_steps=2 + steps, batch_size=new_batch, save_every=1, output_dir=out, loggers=[], seed=3).fit(
        Classifier(), data, resume=True)
    # the rest of the epoch is exactly the items not yet seen, each once
    assert sorted(first + data.served) == list(range(40))
    # each checkpoint of the resumed run records the true global position
    positions = {}
    for path in tmp_path.glob("checkpoint-*"):
        state = json.loads((path / "trainer_state.json").read_text())["state"]
        positions[state["global_step"]] = (state["epoch_index"], state["samples_in_epoch"])
    for k in range(1, steps):
        assert positions[2 + k] == (0, 8 + k * new_batch)
    assert positions[2 + steps] == (1, 0)  # the epoch's last step: the next epoch's start


class FailAtStep(ll.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_start(self, fitter, state, control):
        if state.global_step + 1 == self.step:
            raise RuntimeError("simulated crash")


def _rows(out: Path) -> list[tuple[str, str, str]]:
    with open(out / "logs" / "metrics.csv", newline="") as fh:
        return [tuple(r) for r in csv.reader(fh)][1:]


def test_a_resumed_run_logs_nothing_twice(tmp_path):
    """The checkpoint at an epoch's last step is written after that step's log, evaluation and
    epoch end, so a run resumed from it repeats none of them; nor does re-running a finished fit."""
    kw = dict(max_epochs=3, batch_size=4, log_every=2, save_every=3, eval_on_epoch_end=True,
              loggers=["csv"], seed=1)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ll.Fitter(output_dir=str(ref_dir), **kw).fit(Classifier(), DictDataset(n=12), DictDataset(n=8))
    with pytest.raises(RuntimeError, match="simulated crash"):
        ll.Fitter(output_dir=str(run_dir), callbacks=[FailAtStep(5)], **kw).fit(
            Classifier(), DictDataset(n=12), DictDataset(n=8))
    ll.Fitter(output_dir=str(run_dir), **kw).fit(Classifier(), DictDataset(n=12), DictDataset(n=8), resume=True)
    ll.Fitter(output_dir=str(run_dir), **kw).fit(Classifier(), DictDataset(n=12), DictDataset(n=8), resume=True)
    ref, got = _rows(ref_dir), _rows(run_dir)
    keys = [(s, k) for s, k, _ in got]
    assert len(keys) == len(set(keys)), "a (step, metric) logged twice"
    assert got == ref


class OOMInSecondMicroBatch(Classifier):
    """Runs out of memory (the CPU allocator's error) on any batch above ``limit`` items, but
    only after one micro-batch has put gradients in place."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.calls = limit, 0

    def forward(self, batch):
        self.calls += 1
        if len(batch["x"]) > self.limit and self.calls % 2 == 0:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory")
        return super().forward(batch)


def test_auto_find_batch_size_on_the_cpu_allocator_error_restarts_clean(tmp_path):
    torch.manual_seed(0)
    model = OOMInSecondMicroBatch(limit=8)
    fitter = ll.Fitter(max_steps=3, batch_size=16, grad_accum_steps=2, auto_find_batch_size=True, shuffle=False,
                       output_dir=str(tmp_path / "a"), loggers=[], learning_rate=1e-2)
    fitter.fit(model, DictDataset(n=96))
    assert (fitter.config.batch_size, fitter.config.grad_accum_steps) == (8, 4)
    torch.manual_seed(0)
    ref = Classifier()
    ll.Fitter(max_steps=3, batch_size=8, grad_accum_steps=4, shuffle=False, output_dir=str(tmp_path / "b"),
              loggers=[], learning_rate=1e-2).fit(ref, DictDataset(n=96))
    assert torch.equal(flat_params(model), flat_params(ref))  # no gradient left over from the failed try


def test_auto_find_batch_size_starts_the_user_states_again_too(tmp_path):
    """A retry starts from the first try's start: the user's states (Fitter(states=...)) as well
    as the weights, so an EMA updated by the failed try's two steps ends as a fresh run's."""
    from helpers import EMA, KeepsEMA

    class OOMAtStepThree(Classifier):
        calls = 0

        def forward(self, batch):
            self.calls += 1
            if len(batch["x"]) > 8 and self.calls == 5:  # step 3's first micro-batch of the first try
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory")
            return super().forward(batch)

    def run(name, module, batch_size, grad_accum_steps, **kw):
        ema = EMA()
        ll.Fitter(max_steps=3, batch_size=batch_size, grad_accum_steps=grad_accum_steps, shuffle=False,
                  output_dir=str(tmp_path / name), loggers=[], learning_rate=1e-2, states={"ema": ema},
                  callbacks=[KeepsEMA(ema)], **kw).fit(module, DictDataset(n=96))
        return ema

    torch.manual_seed(0)
    retried = run("a", OOMAtStepThree(), 16, 2, auto_find_batch_size=True)  # retried as 8 x 4
    torch.manual_seed(0)
    reference = run("b", Classifier(), 8, 4)
    assert retried.updates == reference.updates == 3
    assert torch.equal(retried.shadow, reference.shadow)


def test_items_seen_counts_every_item(tmp_path):
    result = ll.Fitter(max_steps=5, batch_size=4, log_every=2, output_dir=str(tmp_path), loggers=[]).fit(
        Classifier(), DictDataset(n=12))
    assert result.state.items_seen == 5 * 4


def test_an_empty_dataloader_names_the_problem(tmp_path):
    loader = DataLoader(DictDataset(n=3), batch_size=4, drop_last=True)
    with pytest.raises(DataError, match="no batch per epoch"):
        ll.Fitter(max_epochs=1, output_dir=str(tmp_path), loggers=[]).fit(Classifier(), loader)


def test_a_micro_batch_without_items_is_named_in_the_error(tmp_path):
    class MaskedOut(Classifier):
        def num_items(self, batch):
            return 0 if bool((batch["y"] >= 0).all()) else len(batch["y"])

        def loss(self, outputs, batch):
            return outputs.sum() * 0 / 0.0  # the mean over no item

    with pytest.raises(NonFiniteLossError, match="holds 0 items"):
        ll.Fitter(max_steps=2, batch_size=4, log_every=1, output_dir=str(tmp_path), loggers=[]).fit(
            MaskedOut(), DictDataset(n=8))


def test_should_log_at_an_epoch_end_after_that_steps_log_adds_no_row(tmp_path):
    rec = Recorder(at_epoch_end=("should_log",))
    ll.Fitter(max_epochs=2, batch_size=4, log_every=1, output_dir=str(tmp_path), loggers=["csv"],
              callbacks=[rec]).fit(Classifier(), DictDataset(n=12))
    keys = [(s, k) for s, k, _ in _rows(tmp_path)]
    assert len(keys) == len(set(keys)) and ("6", "train/loss") in keys


class Rising(Classifier):
    """val/score rises with every evaluation: the last evaluation is the best."""

    evals = 0

    def metrics(self, outputs, batch):
        return {"score": torch.tensor(float(self.evals))}


class CountEvalsAndStopAt(ll.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True

    def on_evaluate(self, fitter, state, control, metrics):
        fitter.module.evals += 1


def test_a_run_stopped_early_evaluates_before_its_last_checkpoint(tmp_path):
    """Stopped by a callback at step 6 (max_steps 20): the final evaluation (the new best) runs
    before checkpoint-6 is written, so checkpoint-6 holds it and is the best checkpoint."""
    result = ll.Fitter(max_steps=20, batch_size=4, save_every=2, eval_every=4, metric_for_best="val/score",
                       greater_is_better=True, load_best_at_end=True, output_dir=str(tmp_path), loggers=[],
                       callbacks=[CountEvalsAndStopAt(6)]).fit(Rising(), DictDataset(n=40), DictDataset(n=4))
    assert result.global_step == 6 and result.state.best_step == 6
    assert Path(result.best_checkpoint).name == "checkpoint-6"
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())["state"]
    assert state["last_eval_step"] == 6 and state["best_step"] == 6


def test_a_changed_schedule_applies_from_the_first_resumed_step(tmp_path):
    """max_steps 2 -> 20 on resume (linear decay from 0.01, no warmup): step 3 runs at
    0.01 * (1 - 2/20) = 0.009, not at the old schedule's end value (0)."""
    class LR(ll.Callback):
        lrs: dict = {}

        def on_before_optimizer_step(self, fitter, state, control, optimizer):
            LR.lrs[state.global_step + 1] = optimizer.param_groups[0]["lr"]

    kw = dict(batch_size=4, learning_rate=0.01, lr_scheduler="linear", save_every=2, output_dir=str(tmp_path),
              loggers=[], callbacks=[LR()])
    ll.Fitter(max_steps=2, **kw).fit(Classifier(), DictDataset(n=40))
    ll.Fitter(max_steps=20, **kw).fit(Classifier(), DictDataset(n=40), resume=True)
    assert LR.lrs[3] == pytest.approx(0.009) and LR.lrs[4] == pytest.approx(0.0085)


def test_a_best_checkpoint_that_rotation_removed_is_not_loaded(tmp_path, caplog):
    from lightlike.checkpoint.resume import resolve_best

    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "manifest.json").write_text("{}")
    assert resolve_best(tmp_path, "checkpoint-4", 4) == str(tmp_path / "checkpoint-4")
    with caplog.at_level("WARNING", logger="lightlike"):
        assert resolve_best(tmp_path, "checkpoint-2", 2) is None
    assert "checkpoint-2" in caplog.text


def test_resume_skips_weights_only_checkpoints(tmp_path):
    """resume=True / 'auto' take the newest *resumable* checkpoint: a newer weights-only one
    (save_only_model) is passed over, not an error."""
    kw = dict(batch_size=4, save_every=2, output_dir=str(tmp_path), loggers=[])
    ll.Fitter(max_steps=2, **kw).fit(Classifier(), DictDataset(n=40))
    ll.Fitter(max_steps=4, save_only_model=True, **kw).fit(Classifier(), DictDataset(n=40), resume=True)
    assert (tmp_path / "checkpoint-4").is_dir()
    fitter = ll.Fitter(max_steps=6, **kw)
    result = fitter.fit(Classifier(), DictDataset(n=40), resume="auto")
    assert Path(fitter.resumed_from).name == "checkpoint-2" and result.global_step == 6


def test_the_even_split_holds_from_any_resume_position():
    """Training on W ranks deals every rank the same number of samples; a resume may start at a
    position that is not a multiple of the new W (2 ranks -> 3): the rest still splits evenly,
    each sample once, and the position reaches the split's end."""
    from lightlike.data.sampler import ResumableSampler

    for start in (0, 20, 21, 37):
        shares = []
        for rank in range(3):
            s = ResumableSampler(40, seed=1, rank=rank, world_size=3, even=True)
            s.set_epoch(0, start)
            shares.append(list(s))
        assert len({len(x) for x in shares}) == 1, (start, [len(x) for x in shares])
        dealt = sum(shares, [])
        assert len(dealt) == len(set(dealt)) == (40 - start) - (40 - start) % 3
        assert start + len(dealt) == s.global_end()


def test_a_fit_after_one_that_failed_mid_window_starts_from_zero_gradients(tmp_path):
    """The loss raised at step 3's second micro-batch (accumulation 2): the first micro-batch's
    gradients stayed in the module, and the next fit of that module added them to its first
    step. It must equal a fit of a fresh module with the same weights."""
    import copy

    class FailsOnce(Classifier):
        calls, fail = 0, True

        def loss(self, outputs, batch):
            type(self).calls += 1
            if self.fail and type(self).calls == 6:  # step 3 (two micro-batches a step), the second
                raise RuntimeError("boom")
            return super().loss(outputs, batch)

    def fit(module, name):
        ll.Fitter(max_steps=4, batch_size=4, grad_accum_steps=2, shuffle=False, output_dir=str(tmp_path / name),
                  loggers=[], model_summary=False).fit(module, DictDataset(n=32))

    torch.manual_seed(0)
    module = FailsOnce()
    with pytest.raises(RuntimeError, match="boom"):
        fit(module, "failed")
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())  # left by the failure
    module.fail = False
    start = copy.deepcopy(module.state_dict())
    fit(module, "again")
    reference = FailsOnce()
    reference.fail = False
    reference.load_state_dict(start)
    fit(reference, "fresh")
    for (name, got), want in zip(module.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_the_step_boundary_decision_is_a_value_of_the_schedule_and_the_live_flags():
    """``BoundaryPlan`` decides what a boundary does from numbers and the callbacks' flags (read live:
    a flag set in ``on_log`` counts at the same boundary); checked here without a fit."""
    from lightlike.loop import BoundaryPlan
    from lightlike.state import Control, FitState

    config = ll.FitConfig(log_every=5, eval_every=7, max_steps=12)
    def due(step, epoch_done=False, epoch_index=0, epoch_limit=float("inf"), has_eval_sets=True):
        return BoundaryPlan.at(step, config, max_steps=12, epoch_done=epoch_done, epoch_index=epoch_index,
                      epoch_limit=epoch_limit, has_eval_sets=has_eval_sets)

    control, state = Control(), FitState()
    plain = due(3)
    assert plain.quiet(control)  # nothing scheduled, nothing asked for: the boundary does nothing
    assert not any(due(step).quiet(control) for step in (5, 7, 12))  # a log, an evaluation, the last step
    assert not due(3, epoch_done=True).quiet(control)
    saving = ll.FitConfig(log_every=5, save_strategy="steps", save_every=4, max_steps=12)
    assert not BoundaryPlan.at(8, saving, max_steps=12, epoch_done=False, epoch_index=0, epoch_limit=1,
                      has_eval_sets=False).quiet(control)
    for flag in ("should_log", "should_evaluate", "should_save", "should_epoch_stop", "should_training_stop"):
        setattr(control, flag, True)
        assert not plain.quiet(control), flag
        setattr(control, flag, False)
    assert (plain.log(control), plain.evaluate(control, state), plain.ends_epoch(control), plain.ends_run(control)) \
        == (False, False, False, False)
    assert due(5).log(control) and not due(5).evaluate(control, state)
    assert due(7).evaluate(control, state) and not due(7).log(control)
    last = due(12)  # the budget's last step: logged and evaluated, whatever the schedule says
    assert last.ends_run(control) and last.log(control) and last.evaluate(control, state)
    state.last_eval_step = 12  # evaluated already at this step: not twice
    assert not last.evaluate(control, state)
    assert due(6, epoch_done=True, epoch_index=1, epoch_limit=2).ends_run(control)  # the last epoch's end
    assert not due(6, epoch_done=True, epoch_index=0, epoch_limit=2).ends_run(control)
    control.should_training_stop = True  # set by a callback in on_log: the same boundary ends the run
    assert plain.ends_run(control) and plain.log(control)
    with pytest.raises(AttributeError):
        plain.step = 4  # a value: the boundary cannot change it

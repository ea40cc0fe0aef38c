"""auto_find_batch_size, gradient checkpointing, torch.compile, FitResult figures."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, DictDataset, flat_params

import lightlike as ll


class OOMAbove(Classifier):
    """Raises torch's out-of-memory error for micro-batches larger than ``limit``."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.sizes = []

    def forward(self, batch):
        self.sizes.append(len(batch["x"]))
        if len(batch["x"]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().forward(batch)


def test_auto_find_batch_size_halves_and_restarts_exactly(tmp_path):
    torch.manual_seed(0)
    model = OOMAbove(limit=4)
    fitter = ll.Fitter(max_steps=3, batch_size=16, auto_find_batch_size=True, shuffle=False,
                       output_dir=str(tmp_path / "a"), loggers=[], learning_rate=1e-2)
    result = fitter.fit(model, DictDataset(n=48))
    assert fitter.config.batch_size == 4 and fitter.config.grad_accum_steps == 4
    assert result.global_step == 3
    # the same effective batch (16) from the same initial weights as a run at batch 4 x 4
    torch.manual_seed(0)
    ref = Classifier()
    ll.Fitter(max_steps=3, batch_size=4, grad_accum_steps=4, shuffle=False, output_dir=str(tmp_path / "b"),
              loggers=[], learning_rate=1e-2).fit(ref, DictDataset(n=48))
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-7)


class OOMAboveFrom(OOMAbove):
    """Runs out of memory for micro-batches larger than ``limit`` from its ``after``-th forward on
    (a failed try that trained and saved a few steps first)."""

    def __init__(self, limit, after):
        super().__init__(limit)
        self.after = after

    def forward(self, batch):
        self.sizes.append(len(batch["x"]))
        if len(self.sizes) > self.after and len(batch["x"]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return Classifier.forward(self, batch)


def reference_run(tmp_path, name, batch_size, accum, **kw):
    torch.manual_seed(0)
    ref = Classifier()
    result = ll.Fitter(batch_size=batch_size, grad_accum_steps=accum, output_dir=str(tmp_path / name), loggers=[],
                       **kw).fit(ref, DictDataset(n=48))
    return ref, result


def test_an_out_of_memory_retry_starts_with_a_fresh_loss_scale(tmp_path):
    """16-mixed: the failed tries' overflow skips had lowered the GradScaler's scale, and the retry
    started from it (0 skipped steps against the reference's 4, other weights); two fits with one
    Fitter shared it too."""
    kw = dict(max_steps=8, shuffle=False, learning_rate=1e-2, seed=0)
    prec = lambda: ll.precision.MixedPrecision("16", init_scale=2.0**22)  # noqa: E731  overflows a few steps
    torch.manual_seed(0)
    model = OOMAboveFrom(limit=8, after=4)
    fitter = ll.Fitter(batch_size=32, auto_find_batch_size=True, precision=prec(), output_dir=str(tmp_path / "a"),
                       loggers=[], **kw)
    result = fitter.fit(model, DictDataset(n=48))
    assert (fitter.config.batch_size, fitter.config.grad_accum_steps) == (8, 4)
    ref, ref_result = reference_run(tmp_path, "b", 8, 4, precision=prec(), **kw)
    assert ref_result.skipped_steps > 0
    assert result.skipped_steps == ref_result.skipped_steps
    assert torch.equal(flat_params(model), flat_params(ref))
    # one Fitter, two fits: the second starts from the initial scale too
    fitter.config = fitter.config.replace(overwrite_output_dir=True, auto_find_batch_size=False)
    torch.manual_seed(0)
    again = Classifier()
    assert fitter.fit(again, DictDataset(n=48)).skipped_steps == ref_result.skipped_steps
    assert torch.equal(flat_params(again), flat_params(ref))


@pytest.mark.parametrize("resume", ["auto", None])
def test_an_out_of_memory_retry_does_not_resume_the_failed_try(tmp_path, resume):
    """resume='auto' on an empty output_dir: the retry found the failed try's own checkpoint-4
    (batch 32) and resumed it, ending with other weights than a run started at the found size."""
    kw = dict(max_steps=8, shuffle=False, learning_rate=1e-2, seed=0, save_every=2)
    torch.manual_seed(0)
    model = OOMAboveFrom(limit=8, after=4)
    fitter = ll.Fitter(batch_size=32, auto_find_batch_size=True, output_dir=str(tmp_path / "a"), loggers=[], **kw)
    fitter.fit(model, DictDataset(n=48), resume=resume)
    assert fitter.resumed_from is None
    ref, _ = reference_run(tmp_path, "b", 8, 4, **kw)
    assert torch.equal(flat_params(model), flat_params(ref))


@pytest.mark.parametrize("limit", [None, 1])
def test_an_out_of_memory_retry_resumes_where_the_first_try_did(tmp_path, limit):
    """A first try that resumed checkpoint-2 and wrote checkpoint-4 before running out of memory:
    the retry resumes checkpoint-2 again (the failed try's newer checkpoint is set aside). With
    save_total_limit=1 rotation had deleted checkpoint-2 and the retry failed: the checkpoint a
    fit with auto_find_batch_size resumed from is kept."""
    kw = dict(shuffle=False, learning_rate=1e-2, seed=0, save_every=2, save_total_limit=limit)
    out = tmp_path / "a"

    class StopAt2(ll.Callback):
        def on_step_end(self, fitter, state, control):
            control.should_training_stop = state.global_step == 2

    torch.manual_seed(0)
    ll.Fitter(max_steps=8, batch_size=8, grad_accum_steps=4, output_dir=str(out), loggers=[], callbacks=[StopAt2()],
              **kw).fit(Classifier(), DictDataset(n=48))
    torch.manual_seed(0)
    model = OOMAboveFrom(limit=8, after=3)  # 2 steps at batch 32 x 1, then out of memory
    fitter = ll.Fitter(max_steps=8, batch_size=32, auto_find_batch_size=True, output_dir=str(out), loggers=[], **kw)
    fitter.fit(model, DictDataset(n=48), resume=True)
    assert fitter.resumed_from == str(out / "checkpoint-2")
    ref, _ = reference_run(tmp_path, "b", 8, 4, max_steps=8, **kw)
    assert torch.equal(flat_params(model), flat_params(ref))
    if limit:  # kept for a retry, then rotated as usual once the fit is done
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-8"]


@pytest.mark.parametrize(("batch", "limit", "found"), [(12, 4, (3, 4)), (5, 2, (1, 5)), (16, 4, (4, 4))])
def test_an_out_of_memory_retry_keeps_the_items_per_step(tmp_path, batch, limit, found):
    """12 was halved to 6, 3, then 1 x 8: 8 items per step instead of 12 (5 -> 2 x 2 = 4)."""
    from lightlike.utils.oom import smaller_batch

    assert smaller_batch(12, 1) == (6, 2) and smaller_batch(6, 2) == (3, 4) and smaller_batch(3, 4) == (1, 12)
    kw = dict(max_epochs=2, shuffle=False, learning_rate=1e-2, seed=0)
    torch.manual_seed(0)
    model = OOMAbove(limit=limit)
    fitter = ll.Fitter(batch_size=batch, auto_find_batch_size=True, output_dir=str(tmp_path / "a"), loggers=[], **kw)
    result = fitter.fit(model, DictDataset(n=48))
    assert (fitter.config.batch_size, fitter.config.grad_accum_steps) == found
    ref, ref_result = reference_run(tmp_path, "b", *found, **kw)
    assert result.global_step == ref_result.global_step == 2 * -(-48 // batch)
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-7)


def test_auto_find_batch_size_refuses_a_dataloader(tmp_path):
    """A DataLoader's batch size is its own: halving batch_size and doubling the accumulation
    would double the items per step without a word (16 -> 32)."""
    loader = torch.utils.data.DataLoader(DictDataset(n=48), batch_size=16)
    fitter = ll.Fitter(max_steps=3, batch_size=16, auto_find_batch_size=True, output_dir=str(tmp_path), loggers=[])
    with pytest.raises(ll.ConfigError, match="auto_find_batch_size=True needs the training Dataset, not a DataLoader"):
        fitter.fit(OOMAbove(limit=4), loader)


def test_a_preemption_signal_before_an_out_of_memory_retry_is_kept(tmp_path):
    """SIGTERM arrives during the step that then runs out of memory: the retry with a smaller
    batch must still save and exit 75 at its first step boundary (the signal was dropped with
    the failed try's handler, and the job trained on until SLURM killed it)."""
    import os
    import signal

    from lightlike.preemption import Preempted

    class SignalThenOOM(OOMAbove):
        def forward(self, batch):
            if len(batch["x"]) > self.limit:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().forward(batch)

    fitter = ll.Fitter(max_steps=6, batch_size=8, auto_find_batch_size=True, save_every=100, requeue_on_preemption=False,
                       output_dir=str(tmp_path), loggers=[])
    with pytest.raises(Preempted, match=r"preempted by SIGTERM; checkpoint \S+checkpoint-1; exit code 75"):
        fitter.fit(SignalThenOOM(limit=4), DictDataset(n=48))
    assert fitter.state.global_step == 1 and (tmp_path / "checkpoint-1").is_dir()


def test_preemption_handlers_cover_set_up_after_the_process_group(tmp_path):
    """Installed once the process group is up (a signal during a resume's checkpoint load is
    acted on at the first step), not before: a rank waiting to meet a peer that failed to start
    must still end at the launcher's SIGTERM (it ignored it and hung for torchrun's 30 s grace)."""
    import signal

    seen = {}

    class Probe(ll.Fitter):
        def setup_strategy(self):
            seen["meeting"] = signal.getsignal(signal.SIGTERM)
            return super().setup_strategy()

    class Model(Classifier):  # its optimizer is built during set-up, after the process group
        def configure_optimizers(self, config):
            seen["set-up"] = signal.getsignal(signal.SIGTERM)
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    before = signal.getsignal(signal.SIGTERM)
    fitter = Probe(max_steps=1, batch_size=4, output_dir=str(tmp_path), loggers=[])
    fitter.fit(Model(), DictDataset(n=8))
    assert seen["meeting"] == before
    assert seen["set-up"] == fitter.preemption._handle
    assert signal.getsignal(signal.SIGTERM) == before


def test_uncatchable_preemption_signals_are_refused_up_front():
    """SIGKILL in preemption_signals raised a raw OSError inside fit and left SIGTERM's handler
    installed (every later SIGTERM swallowed): a ConfigError when the Fitter is built."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    for names in (["SIGTERM", "SIGKILL"], ["SIGSTOP"], ["SIGBOGUS"]):
        with pytest.raises(ll.ConfigError, match="preemption_signals"):
            ll.Fitter(max_steps=1, preemption_signals=names)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_fit_restores_the_previous_signal_handlers_and_watches_nothing_after(tmp_path):
    """Handlers of the caller's (not only the default ones) are back after a fit, for every
    preemption signal, and no signal is watched outside the fit (its workers would ignore it)."""
    import signal

    from lightlike.preemption import watched_signals

    def mine(signum, frame):
        pass

    seen = {}

    class Probe(ll.Callback):
        def on_step_end(self, fitter, state, control):
            seen["during"] = watched_signals()

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        ll.Fitter(max_steps=2, batch_size=4, preemption_signals=["SIGTERM", "SIGUSR1"], output_dir=str(tmp_path),
                  loggers=[], callbacks=[Probe()]).fit(Classifier(), DictDataset(n=8))
        assert seen["during"] == (signal.SIGTERM, signal.SIGUSR1)
        assert watched_signals() == ()
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_signal_with_a_stop_set_in_on_save_ends_the_run_normally(tmp_path, caplog):
    """A callback stops training in on_save at the step the signal arrived: the run ends there
    anyway, so it returns normally (no Preempted, no requeue) and says so."""
    import logging
    import os
    import signal

    class StopOnSaveAndTerm(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_save(self, fitter, state, control, path):
            control.should_training_stop = True

    with caplog.at_level(logging.WARNING, logger="lightlike"):
        result = ll.Fitter(max_steps=6, batch_size=4, save_every=3, output_dir=str(tmp_path), loggers=[],
                           callbacks=[StopOnSaveAndTerm()]).fit(Classifier(), DictDataset(n=40))
    assert result.global_step == 3
    assert "SIGTERM received at the run's last step 3: it ends normally (no requeue)" in caplog.text


def test_a_fit_outside_the_main_thread_runs_without_preemption_handlers(tmp_path, caplog):
    """signal.signal works only in the main thread: a fit in another thread warns and trains."""
    import logging
    import threading

    results, errors = [], []

    def work():
        try:
            results.append(ll.Fitter(max_steps=2, batch_size=4, output_dir=str(tmp_path), loggers=[])
                           .fit(Classifier(), DictDataset(n=8)))
        except BaseException as e:  # noqa: BLE001  # reported below
            errors.append(e)

    with caplog.at_level(logging.WARNING, logger="lightlike"):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=120)
    assert not errors, errors
    assert results and results[0].global_step == 2
    assert "fit() is not running in the main thread: preemption signals are not handled" in caplog.text


def test_without_auto_find_oom_propagates(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        ll.Fitter(max_steps=1, batch_size=16, output_dir=str(tmp_path), loggers=[]).fit(OOMAbove(4), DictDataset(n=32))


def test_gradient_checkpointing_same_gradients(tmp_path):
    class Checkpointed(Classifier):
        calls = 0

        def forward(self, batch):
            def body(x):
                type(self).calls += 1
                return self.net(x)
            return self.maybe_checkpoint(body, batch["x"])

    def run(flag):
        torch.manual_seed(0)
        m = Checkpointed()
        Checkpointed.calls = 0
        ll.Fitter(max_steps=3, batch_size=4, gradient_checkpointing=flag, output_dir=str(tmp_path / str(flag)),
                  loggers=[]).fit(m, DictDataset(n=12))
        return flat_params(m), Checkpointed.calls

    plain, plain_calls = run(False)
    ckpt, ckpt_calls = run(True)
    assert torch.equal(plain, ckpt)
    assert plain_calls == 3 and ckpt_calls == 6  # recomputed in backward


class UncountedNorm(torch.nn.BatchNorm1d):
    def forward(self, x):
        return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                              self.training, 0.1, self.eps)


@pytest.mark.parametrize("form", ["function", "module", "function-after-norm", "method-after-norm", "uncounted-norm"])
def test_gradient_checkpointing_updates_running_statistics_once(tmp_path, form):
    """The recompute in backward runs BatchNorm's training forward again: its running mean,
    variance and batch count were updated twice per micro-batch, so switching checkpointing on
    changed the trained model (running_var 0.36 against 0.14, num_batches_tracked 20 against 10).
    Every tensor of the state, buffers included, must equal the run without it."""
    from torch import nn

    class WithNorm(Classifier):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 3), nn.BatchNorm1d(3))

            self.pre = nn.BatchNorm1d(8)  # outside the checkpoint: its statistics are not the recompute's
            if form == "uncounted-norm":  # a SyncBN-style subclass that keeps no batch count
                self.body[4] = UncountedNorm(3)

        def forward(self, batch):
            x = self.pre(batch["x"]) if form.endswith("after-norm") else batch["x"]
            if form == "module":
                return self.maybe_checkpoint(self.body, x)
            if form == "method-after-norm":  # as HF passes layer.__call__
                return self.maybe_checkpoint(self.body.forward, x)
            return self.maybe_checkpoint(lambda x: self.body(x), x)

    def run(flag):
        torch.manual_seed(0)
        m = WithNorm()
        ll.Fitter(max_steps=5, batch_size=4, grad_accum_steps=2, max_grad_norm=1.0, gradient_checkpointing=flag,
                  output_dir=str(tmp_path / f"{form}{flag}"), loggers=[], seed=0).fit(m, DictDataset(n=40))
        return m.state_dict()

    plain, ckpt = run(False), run(True)
    assert int(plain["body.4.num_batches_tracked"]) == (0 if form == "uncounted-norm" else 10)
    for k in plain:
        assert torch.equal(plain[k], ckpt[k]), k


def test_gradient_checkpointing_under_compile(tmp_path):
    """compile=True with gradient_checkpointing=True crashed at the first step for every module
    using maybe_checkpoint (dynamo cannot trace its buffer-keeping context_fn). Under compile
    the checkpoint goes without it; the compiled graph updates BatchNorm's statistics once."""
    from torch import nn

    class WithNorm(Classifier):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3), nn.BatchNorm1d(3))

        def forward(self, batch):
            return self.maybe_checkpoint(self.body, batch["x"])

    def run(flag):
        torch.manual_seed(0)
        m = WithNorm()
        ll.Fitter(max_steps=3, batch_size=4, compile=True, gradient_checkpointing=flag, save_strategy="no",
                  output_dir=str(tmp_path / str(flag)), loggers=[], seed=0).fit(m, DictDataset(n=12))
        return m.state_dict()

    plain, ckpt = run(False), run(True)
    assert int(ckpt["body.3.num_batches_tracked"]) == int(plain["body.3.num_batches_tracked"]) == 3
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-6, msg=k)


def test_gradient_checkpointing_that_does_nothing_is_reported(tmp_path, caplog):
    """A module whose forward never calls maybe_checkpoint gets a warning (the switch would do
    nothing); one that calls it does not."""
    class Checkpointed(Classifier):
        def forward(self, batch):
            return self.maybe_checkpoint(self.net, batch["x"])

    for cls, warned in ((Classifier, True), (Checkpointed, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="lightlike"):
            ll.Fitter(max_steps=2, batch_size=4, gradient_checkpointing=True, output_dir=str(tmp_path / cls.__name__),
                      loggers=[]).fit(cls(), DictDataset(n=8))
        assert ("no activation is checkpointed" in caplog.text) is warned, cls.__name__
        assert caplog.text.count("no activation is checkpointed") <= 1


def test_compile_switch(tmp_path):
    torch.manual_seed(0)
    m = Classifier()
    fitter = ll.Fitter(max_steps=2, batch_size=4, compile=True, output_dir=str(tmp_path), loggers=[])
    torch._dynamo.reset()
    result = fitter.fit(m, DictDataset(n=8))
    assert result.global_step == 2
    assert fitter.model is m and fitter.module is m  # compiled as a function: the module is not wrapped


def test_fit_result_figures(tmp_path):
    result = ll.Fitter(max_steps=5, batch_size=4, output_dir=str(tmp_path), loggers=[]).fit(
        Classifier(), DictDataset(n=40), DictDataset(n=8))
    assert result.global_step == 5
    assert result.runtime > 0 and result.steps_per_second > 0
    assert result.samples_per_second == pytest.approx(result.steps_per_second * 4, rel=1e-9)
    assert result.peak_memory_bytes is None or result.peak_memory_bytes > 0
    assert set(result.metrics) == {"val/loss", "val/accuracy", "train/loss"}


def test_deterministic_is_on_for_the_fitter_s_own_calls_only(tmp_path):
    """deterministic=True switched torch's deterministic algorithms on for the whole process,
    already when the Fitter was built, and never back: a later fit without it ran
    deterministically too. Now: on during fit/validate/test/predict, as before them after."""
    seen = []

    class Watch(ll.Callback):
        def on_step_end(self, fitter, state, control):
            seen.append(torch.are_deterministic_algorithms_enabled())

    assert not torch.are_deterministic_algorithms_enabled()
    fitter = ll.Fitter(max_steps=2, batch_size=4, deterministic=True, output_dir=str(tmp_path / "a"), loggers=[],
                       log_level="warning", callbacks=[Watch()])
    assert not torch.are_deterministic_algorithms_enabled()  # building it switches nothing on
    module = Classifier()
    fitter.fit(module, DictDataset(n=8))
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()

    class Probe(Classifier):
        def metrics(self, outputs, batch):
            seen.append(torch.are_deterministic_algorithms_enabled())
            return super().metrics(outputs, batch)

    seen.clear()
    fitter.validate(Probe(), DictDataset(n=4))
    ll.Fitter(max_steps=2, batch_size=4, output_dir=str(tmp_path / "b"), loggers=[], log_level="warning",
              callbacks=[Watch()]).fit(Classifier(), DictDataset(n=8))
    assert seen == [True, False, False] and not torch.are_deterministic_algorithms_enabled()


def test_a_failed_fit_s_traceback_keeps_no_dataloader_worker_alive(tmp_path):
    """A notebook keeps the last exception, whose traceback holds the fit's frame: its epoch
    iterator (a local) kept 2 DataLoader workers, their queue threads and descriptors alive."""
    import multiprocessing

    class Boom(ll.Callback):
        def on_step_end(self, fitter, state, control):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as caught:
        ll.Fitter(max_steps=4, batch_size=4, num_workers=2, output_dir=str(tmp_path), loggers=[], log_level="warning",
                  callbacks=[Boom()]).fit(Classifier(), DictDataset(n=16))
    assert caught.value.__traceback__ is not None  # still held here
    assert multiprocessing.active_children() == []

    class Broken(DictDataset):  # the commonest data failure: raised in a worker, re-raised from
        def __getitem__(self, i):  # inside the DataLoader's iterator, whose frames the traceback holds
            if i == 9:
                raise ValueError("bad item 9")
            return super().__getitem__(i)

    fitter = ll.Fitter(max_steps=4, batch_size=4, num_workers=2, eval_batch_size=4, shuffle=False,
                       output_dir=str(tmp_path / "data"), loggers=[], log_level="warning")
    with pytest.raises(ValueError, match="bad item 9") as caught:
        fitter.fit(Classifier(), Broken(n=16))
    assert caught.value.__traceback__ is not None and multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="bad item 9") as caught:
        fitter.validate(Classifier(), Broken(n=16))
    assert caught.value.__traceback__ is not None and multiprocessing.active_children() == []


def test_a_failed_call_inside_a_fit_ends_only_its_own_dataloader_workers(tmp_path):
    """A callback's validate() that fails (and is caught by the callback) shut down every live
    iterator in the process, the outer fit's training one too: the fit then ended its epoch at
    once, silently (3 steps of 20)."""

    class Broken(DictDataset):
        def __getitem__(self, i):
            raise ValueError("bad eval item")

    class TryValidate(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 2:
                inner = ll.Fitter(eval_batch_size=4, num_workers=2, output_dir=str(tmp_path / "inner"), loggers=[],
                                  log_level="warning")
                with pytest.raises(ValueError, match="bad eval item"):
                    inner.validate(Classifier(), Broken(n=8))

    result = ll.Fitter(max_epochs=1, batch_size=2, num_workers=2, output_dir=str(tmp_path / "outer"), loggers=[],
                       log_level="warning", callbacks=[TryValidate()]).fit(Classifier(), DictDataset(n=40))
    assert result.global_step == 20

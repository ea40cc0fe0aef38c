"""The progress bar's second bar over an evaluation's batches, read from what the real tqdm
wrote, and the ``on_eval_batch_end`` event it is drawn from (issue 35)."""

from __future__ import annotations

import io
import re

from helpers import Classifier, DictDataset

import lightlike as ll
from lightlike.callbacks.progress import ProgressBar


def test_an_evaluation_bar_counts_each_sets_batches_and_is_removed_after_it(tmp_path):
    """Evaluations at steps 2 and 4 over "val" (6 items in batches of 2: 3 batches) and "extra"
    (3 items: 2 batches). The event comes after every batch with the set's name, the batch's
    index and the set's length; the bar shows 0/3 then 3/3 (0/2, 2/2), once per evaluation, and
    is closed before the metrics line is written (none open after the fit)."""
    buf, events = io.StringIO(), []

    class Batches(ll.Callback):
        def on_eval_batch_end(self, fitter, state, control, name, batch, num_batches):
            events.append((state.global_step, name, batch, num_batches))

    bar = ProgressBar(enabled=True, file=buf)
    ll.Fitter(max_steps=4, batch_size=4, eval_batch_size=2, eval_every=2, output_dir=str(tmp_path), loggers=[],
              model_summary=False, save_strategy="no", progress_bar=False, log_level="error",
              callbacks=[bar, Batches()]).fit(Classifier(), DictDataset(n=16),
                                              {"val": DictDataset(n=6, seed=1), "extra": DictDataset(n=3, seed=2)})
    expected = [(step, name, i, n) for step in (2, 4) for name, n in (("val", 3), ("extra", 2)) for i in range(n)]
    assert events == expected
    frames = re.split(r"[\r\n]", buf.getvalue())
    shown = [(m.group(1), m.group(2)) for f in frames for m in [re.search(r"evaluate (\w+):.*?\| (\d+/\d+) ", f)] if m]
    assert shown == [("val", "0/3"), ("val", "3/3"), ("extra", "0/2"), ("extra", "2/2")] * 2, shown
    assert any("4/4" in f and f.lstrip().startswith("fit") for f in frames)
    cleared = [f for f in frames if f.endswith("\x1b[A") and not f[:-3].strip()]  # a bar's line blanked
    assert len(cleared) == 4  # each set's bar, at each evaluation (leave=False)
    assert "step 4: val/accuracy=" in buf.getvalue()
    assert bar.eval_bar is None and bar.bar is None


def test_no_bar_no_eval_batch_calls(tmp_path):
    """Without a callback listening, evaluation gets no per-batch hook at all."""
    from types import SimpleNamespace

    from lightlike.callbacks.base import CallbackList

    fitter = SimpleNamespace(state=None, control=None)
    assert CallbackList([ProgressBar(enabled=False)]).hook("on_eval_batch_end", fitter) is not None  # it overrides it
    assert CallbackList([ll.EarlyStopping()]).hook("on_eval_batch_end", fitter) is None

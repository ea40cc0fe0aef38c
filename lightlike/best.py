"""The best checkpoint's metric (``metric_for_best``): its direction, and its check.

Direction. ``greater_is_better`` decides when it is set. Unset, the metric's name decides (the
part after the set's ``<set>/``): lower is better for a name that ends in ``loss`` (the HF
Trainer's rule) or that has one of ``LOWER_IS_BETTER`` as a word (words are split at anything
that is not a letter or digit: ``error_rate``, ``top1-err``, ``eval_ppl``); higher is better
for any other name (``accuracy``, ``f1``, ``bleu``). The fit logs the direction it follows.

The key. Every evaluation metric is ``<set>/<name>``, so a key ``<set>/<name>`` whose set is not
one of the fit's evaluation sets is refused at set-up. A key without a set (``accuracy``, the
HF Trainer's ``eval_accuracy``, Lightning's ``val_accuracy``) names the one evaluation metric
whose name is that (``resolve_key``): found at the first evaluation, an error listing the
candidates when several sets have it. The names come from ``metrics()``, ``compute_metrics()``
and streaming metrics, known only once a set is evaluated: a name that none of them gives (or
that several give) is found at the first evaluation, and the error is raised after that step's
checkpoint, if one is due, is written and committed (never lost to the typo).
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from lightlike.errors import ConfigError

log = logging.getLogger("lightlike")

#: Words of a metric's name that make lower better when ``greater_is_better`` is unset.
LOWER_IS_BETTER = ("loss", "error", "errors", "err", "perplexity", "ppl", "wer", "cer", "mse", "rmse", "mae",
                   "nll")


def greater_is_better(metric: str, setting: bool | None) -> bool:
    """The direction of ``metric``: the ``greater_is_better`` setting, or by default from the
    name (module docstring): lower for ``...loss`` and for a word of ``LOWER_IS_BETTER``."""
    if setting is not None:
        return setting
    name = metric.rsplit("/", 1)[-1].lower()
    if name.endswith("loss"):
        return False
    return not any(word in LOWER_IS_BETTER for word in re.split(r"[^a-z0-9]+", name))


def is_improvement(value: float, best: float | None, greater_is_better: bool, min_delta: float = 0.0) -> bool:
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best + min_delta if greater_is_better else value < best - min_delta


def key_candidates(key: str, names: Iterable[str]) -> list[str]:
    """The evaluation metrics (``<set>/<name>``) that ``key`` names: itself if it is one; for a key
    without a set, those whose ``<name>`` is the key, or else those that the key spells with the
    HF Trainer's ``eval_`` prefix or with its set's name (``eval_loss``, ``val_loss``: ``val/loss``)."""
    names = sorted(names)
    if key in names:
        return [key]
    if "/" in key:
        return []
    exact = [n for n in names if n.partition("/")[2] == key]
    if exact:
        return exact
    spelled = []
    for n in names:
        set_name, _, name = n.partition("/")
        if key in (f"eval_{name}", f"{set_name}_{name}"):
            spelled.append(n)
    return spelled


def resolve_key(key: str, names: Iterable[str]) -> str:
    """The one evaluation metric ``key`` names (``key_candidates``); a ``ConfigError`` naming the
    metrics there are (and the closest) when there is none, or the candidates when several."""
    names = sorted(names)
    found = key_candidates(key, names)
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"metric_for_best={key!r} matches several evaluation metrics {found}: set "
                          f"metric_for_best to one of them", settings=("metric_for_best",))
    raise ConfigError(f"metric_for_best={key!r} is not among the evaluation metrics {names}"
                      f"{_suggest(key, names)}: set metric_for_best to one of them", settings=("metric_for_best",))


def _suggest(key: str, keys: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


class BestMetric:
    """``metric_for_best`` during one fit: checked against the evaluation sets at set-up, then
    at each evaluation (``update``) the best value and step move in ``state``. A key without a set
    is resolved at the first evaluation (``resolve_key``). A key that the evaluation does not
    have (or names ambiguously) is kept as an error, raised by ``raise_unknown`` once the step's
    checkpoint is written."""

    def __init__(self, config: Any, eval_sets: Iterable[str]):
        self.key: str | None = config.metric_for_best  # the evaluation metric, once a set-less key is resolved
        self.resolved = self.key is None or "/" in self.key
        self.error: ConfigError | None = None
        sets = sorted(eval_sets)
        if self.key is None:
            self.greater = True
            return
        if not sets:
            raise ConfigError(f"metric_for_best={self.key!r} needs evaluation data: pass val=...",
                              settings=("metric_for_best",))
        set_name = self.key.split("/", 1)[0]
        if self.resolved and set_name not in sets:
            losses = [f"{s}/loss" for s in sets]
            raise ConfigError(
                f"metric_for_best={self.key!r} names no evaluation set of this fit: evaluation metrics are "
                f"'<set>/<name>' with the sets {sets} (e.g. {losses[0]!r}){_suggest(self.key, losses)}",
                settings=("metric_for_best",))
        self.greater = greater_is_better(self.key, config.greater_is_better)
        why = "greater_is_better" if config.greater_is_better is not None else "from its name"
        log.info("the best checkpoint follows %s: %s is better (%s)", self.key,
                 "higher" if self.greater else "lower", why)

    def update(self, metrics: dict[str, float], state: Any) -> None:
        """An evaluation's metrics: a new best moves ``state.best_metric``/``best_step``."""
        key = self.key
        if key is None or self.error is not None:
            return
        if not self.resolved or key not in metrics:
            try:
                found = resolve_key(key, metrics)
            except ConfigError as error:
                self.error = error
                return
            if not self.resolved:
                log.info("metric_for_best=%r is %r", key, found)
                self.key, self.resolved, key = found, True, found
        if is_improvement(metrics[key], state.best_metric, self.greater):
            state.best_metric, state.best_step = metrics[key], state.global_step

    def raise_unknown(self, state: Any, commit: Callable[[], Any]) -> None:
        """At the end of a step boundary: a key the evaluation did not have is raised now, after
        the step's checkpoint (if one was due) is written and committed (``commit``)."""
        if self.error is None:
            return
        commit()
        saved = state.last_save_step == state.global_step
        note = f"checkpoint-{state.global_step} was saved first" if saved else "no checkpoint was due at this step"
        raise ConfigError(f"{self.error} (found at the evaluation of step {state.global_step}; {note})",
                          settings=self.error.settings)

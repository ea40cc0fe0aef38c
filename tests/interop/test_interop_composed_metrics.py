"""torchmetrics objects inside a composition (``metric + 0.0``, ``metric * 1.0``) from
``streaming_metrics()``, and the docs' torchmetrics example, on one and several processes.

This file is also the torchrun target of its 3-process tests: ``python THIS_FILE OUT``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launching import launch  # noqa: E402

import lightlike as ll  # noqa: E402

QUIET = dict(loggers=[], progress_bar=False, model_summary=False)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "interop.md"


def items(n, seed=1):
    """``n`` seeded items of 8 features and one of 3 classes."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


class Linear(ll.TaskModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 3)

    def forward(self, batch):
        return self.net(batch["x"])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["y"])

    def predictions(self, outputs, batch):
        return outputs.softmax(-1)


class ComposedAUROC(Linear):
    def streaming_metrics(self):
        from torchmetrics.classification import MulticlassAUROC

        return {"auroc_plus_0": MulticlassAUROC(num_classes=3, thresholds=None) + 0.0}  # list states inside


def composed_auroc(out, n):
    return ll.Fitter(max_steps=1, eval_batch_size=3, output_dir=str(out), **QUIET).validate(ComposedAUROC(), items(n))


def docs_classifier():
    """The ``Classifier`` of docs/interop.md's torchmetrics example, as the page defines it."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if "MulticlassAUROC" in b)
    namespace: dict = {}
    exec(block.split("\ndata = ")[0], namespace)  # the imports and the class, not the example's run
    torch.manual_seed(0)
    return namespace["Classifier"]()


def docs_example_metrics(out):
    """The docs' example on 23 items in batches of 3 (3 processes: a rank's last batch holds one item)."""
    return ll.Fitter(max_steps=1, eval_batch_size=3, output_dir=str(out), **QUIET).validate(docs_classifier(), items(23))


@pytest.fixture(scope="module")
def three_processes(tmp_path_factory):
    pytest.importorskip("torchmetrics")
    out = tmp_path_factory.mktemp("three")
    p = launch(3, out, script=Path(__file__).resolve(), timeout=120)
    assert p.returncode == 0, "\n".join(line for line in p.stderr.splitlines()
                                        if "gloo" in line or "Error" in line or "lightlike" in line)[-3000:]
    return out


def test_composed_metric_on_a_set_smaller_than_the_world_equals_one_process(three_processes, tmp_path):
    """``MulticlassAUROC() + 0.0`` on 2 items and 3 processes: the inner metric gathered with
    torchmetrics' own function, which aborted every rank (gloo) for the rank holding no item."""
    one = composed_auroc(tmp_path, 2)
    for rank in range(3):
        got = json.loads((three_processes / f"composed-rank{rank}.json").read_text())
        assert got.keys() == one.keys()
        assert all(got[k] == pytest.approx(v, abs=1e-6, nan_ok=True) for k, v in one.items()), (rank, got, one)


def test_the_docs_torchmetrics_example_equals_one_process_on_three(three_processes, tmp_path):
    """The docs' example fed logits to MulticlassAUROC, which softmaxes a batch only when a value
    lies outside [0, 1]: a rank's 1-item batch of logits in [0, 1] was not, so AUROC differed
    between 1 and 3 processes (0.4646 vs 0.4672); it feeds probabilities now."""
    pytest.importorskip("torchmetrics")
    one = docs_example_metrics(tmp_path)
    assert {"val/auroc", "val/f1", "val/acc"} <= one.keys()
    for rank in range(3):
        got = json.loads((three_processes / f"docs-rank{rank}.json").read_text())
        assert got.keys() == one.keys()
        for k, v in one.items():
            assert got[k] == pytest.approx(v, abs=1e-6), (rank, k)


def test_sync_on_compute_false_inside_a_composition_is_refused(tmp_path):
    """``MulticlassAccuracy(sync_on_compute=False) * 1.0`` passed the refusal (only the outer
    metric was checked): on several processes each rank reported its own share."""
    pytest.importorskip("torchmetrics")
    from torchmetrics.classification import MulticlassAccuracy

    from lightlike.errors import ModuleContractError
    from lightlike.interop.metrics import TorchMetric, gather_states

    class Unsynced(Linear):
        def streaming_metrics(self):
            return {"acc": MulticlassAccuracy(num_classes=3, sync_on_compute=False) * 1.0}

    with pytest.raises(ModuleContractError, match=r"MulticlassAccuracy\(sync_on_compute=False\) inside "
                                                  r"CompositionalMetric"):
        ll.Fitter(max_steps=1, output_dir=str(tmp_path), **QUIET).validate(Unsynced(), items(4))
    # every metric inside a composition gathers with lightlike's function (an empty rank joins)
    composed = TorchMetric(MulticlassAccuracy(num_classes=3) + MulticlassAccuracy(num_classes=3, average="micro"))
    inner = [m for m in composed.metric.modules() if m is not composed.metric]
    assert len(inner) == 2 and all(m.dist_sync_fn is gather_states for m in inner)


if __name__ == "__main__":  # the 3-process target of ``three_processes``: each rank writes what it got
    rank, target = int(os.environ.get("RANK", "0")), Path(sys.argv[1])
    (target / f"docs-rank{rank}.json").write_text(json.dumps(docs_example_metrics(target / "docs")))
    (target / f"composed-rank{rank}.json").write_text(json.dumps(composed_auroc(target / "composed", 2)))

"""Evaluation and data on real processes (torchrun, gloo, CPU): sets smaller than the world,
DataLoaders and IterableDatasets of the user's split over ranks, variable-length predictions
gathered and padded, each against hand-computed references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import DictDataset
from launching import launch
from test_evaluation import Tagger, TokenMetricTagger, VarLen, token_reference

SCRIPT = Path(__file__).parents[1] / "scripts" / "eval_target.py"


def references():
    """What one process computes by hand: the script's modules, built from the same seed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_target", SCRIPT)
    target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(target)
    torch.manual_seed(0)
    model = target.Module().double()
    torch.manual_seed(0)
    tagger = Tagger()

    def classify(n):
        data = DictDataset(n=n, dtype=torch.float64)
        with torch.no_grad():
            pred = model.net(data.x).argmax(-1)
        return pred, data.y, (pred == data.y).double().mean().item()

    tagged = torch.full((9, 4), -100)
    tags = torch.full((9, 4), -100)
    with torch.no_grad():
        for i, (x, y) in enumerate(VarLen(9).items):
            tagged[i, :len(y)], tags[i, :len(y)] = tagger.net(x).argmax(-1), y
    torch.manual_seed(0)
    token_accuracy, token_loss = token_reference(TokenMetricTagger(), VarLen(9))
    return classify, tagged, tags, token_accuracy, token_loss


@pytest.mark.parametrize("nproc", [2, 3])
def test_eval_and_data_on_several_processes(tmp_path, nproc):
    p = launch(nproc, tmp_path, script=SCRIPT, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    classify, tagged, tags, token_accuracy, token_loss = references()
    for r, res in enumerate(results):
        pred, y, acc = classify(1)
        assert res["tiny_val"]["val/accuracy"] == pytest.approx(acc, abs=1e-12)
        assert res["tiny_val"]["val/n"] == 1.0
        assert res["tiny_pred"][:2] == [pred.tolist(), y.tolist()]
        for key, n in (("user_loader", 7), ("stream", 5)):
            pred, y, acc = classify(n)
            predictions, labels, metrics = res[key]
            assert predictions == pred.tolist() and labels == y.tolist(), (key, r)  # once each, in order
            assert metrics["predict/n"] == n and metrics["predict/label_sum"] == y.sum().item()
            assert metrics["predict/accuracy"] == pytest.approx(acc, abs=1e-12)
        pred, _, _ = classify(3)
        assert res["unlabelled"] == [pred.tolist(), None, {}]
        predictions, labels, metrics = res["varlen"]
        assert predictions == tagged.tolist() and labels == tags.tolist()
        real = tags != -100
        assert metrics["predict/token_accuracy"] == pytest.approx((tagged[real] == tags[real]).double().mean().item())
        # metrics() values weighted by num_items (the batch's real tokens) across ranks: the whole set's
        assert res["token_metric"]["val/token_acc"] == pytest.approx(token_accuracy, abs=1e-12)
        assert res["token_metric"]["val/token_accuracy"] == pytest.approx(token_accuracy, abs=1e-12)
        assert res["token_metric"]["val/loss"] == pytest.approx(token_loss, rel=1e-6)
    # training on a plain DataLoader: rank r takes items r, r + W, ... (8 items; the tail that
    # does not split evenly is left out)
    pred, _, _ = classify(7)
    for res in results:  # tuple predictions come back as a tuple of joined fields, in order
        assert res["pairs"] == ["tuple", [pred.tolist(), [10 * i for i in range(7)]]]
        for name in ("map", "stream", "lists", "lists_shuffled", "lists_split", "map_split"):  # ready-made batches of 3: dealt whole, joined in order
            want = [[pred.tolist(), [10 * i for i in range(7)]], DictDataset(n=7, dtype=torch.float64).y.tolist()]
            assert res[f"prebatched_{name}"] == want, name
        for name, n in (("items", 5), ("batches", 6), ("lists", 5)):  # a SequentialSampler of the first n items
            assert res[f"first_{name}"] == [[pred.tolist()[:n], [10 * i for i in range(n)]], want[1][:n]], name
    for n in (7, 1):  # dataclass and mapping types at any depth, fields in dataset order
        pred, _, _ = classify(n)
        want = ["OrderedDict", "Record", pred.tolist(), [1000 + i for i in range(n)], [2000 + 2 * i for i in range(n)],
                "PairNT", list(range(n))]  # __post_init__ once per item, the namedtuple kept (rank 1+ empty at n=1)
        assert [res[f"records{n}"] for res in results] == [want] * nproc
    for res in results:  # metric keys that differ between ranks: an error everywhere, not a wrong mean
        assert "metrics() returned different keys on different ranks" in res["rank_keys"]
    assert [res["trained"] for res in results] == [list(range(r, 8 - 8 % nproc, nproc)) for r in range(nproc)]


def test_iterable_datasets_whose_length_is_wrong_train_by_epochs_without_losing_step(tmp_path):
    """An IterableDataset's __len__ plans the epochs; the data may disagree. 7 items claiming 8
    on 2 ranks with accumulation 2: rank 1 ran out inside a window, ended its epoch alone and
    the ranks fell out of step (a DataError on one, a closed connection on the other). 13
    items claiming 9: rank 0 (7 items) took batches beyond the 4 every rank takes, and nothing
    said the data held more than its length. Last, a stream empty on one rank in its first epoch."""
    p = launch(2, tmp_path, script=Path(__file__).parents[1] / "scripts" / "iterable_len_target.py", timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    more, fewer = "claims_more", "claims_fewer"
    # 8 claimed: 4 batches per rank and epoch, 2 steps; rank 1 holds 3, which the epoch ends at
    assert r0[more]["steps"] == r1[more]["steps"] == 4
    assert r0[more]["seen"] == [0, 2, 4, 6] * 2 and r1[more]["seen"] == [1, 3, 5] * 2
    assert any("promised 4 batch(es) of this epoch to this process and it ended after 3" in w
               for w in r1[more]["warnings"])
    # 9 claimed: rank 0 is promised 5, rank 1 4: every rank takes 4 (2 steps) an epoch
    assert r0[fewer]["steps"] == r1[fewer]["steps"] == 4
    assert r0[fewer]["seen"] == [0, 2, 4, 6] * 2 and r1[fewer]["seen"] == [1, 3, 5, 7] * 2
    assert any("yields more than the 4 batch(es)" in w for w in r1[fewer]["warnings"])
    # rank 1's first epoch is empty: every rank stops before a step (rank 0 alone trained a step,
    # then lost its peer, when only the empty rank noticed)
    assert r0["empty_first"] == r1["empty_first"]
    assert "epoch 0 of the training data produced no batch" in r0["empty_first"], r0["empty_first"]

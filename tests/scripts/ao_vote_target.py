"""torchrun --nproc_per_node 2 ao_vote_target.py OUT: counts the preemption votes each rank starts
and reads (equal shares: the every-10-steps vote) in a fit that ends normally and in one that a
SIGUSR1 on rank 1 after step 3 preempts; writes OUT/votes-rank{R}.json."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402
from lightlike.preemption import Preempted  # noqa: E402
from lightlike.strategies.collectives import DistributedCollectives  # noqa: E402

counts = {"started": 0, "read": 0}
_original = DistributedCollectives.reduce_flag_async


def counting(self, flag):
    counts["started"] += 1
    read = _original(self, flag)

    def counted():
        counts["read"] += 1
        return read()
    return counted


DistributedCollectives.reduce_flag_async = counting


class SignalAt3(ll.Callback):
    def on_step_end(self, fitter, state, control):
        if fitter.strategy.global_rank == 1 and state.global_step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)


out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
kw = dict(batch_size=4, strategy="ddp", loggers=[], save_every=1000, requeue_on_preemption=False, seed=0)
record = {}
fitter = ll.Fitter(max_steps=25, output_dir=str(out / "normal"), **kw)
result = fitter.fit(Classifier(), DictDataset(n=400))
record["normal"] = {"step": result.global_step, **counts}
counts.update(started=0, read=0)
fitter = ll.Fitter(max_steps=30, output_dir=str(out / "preempted"), callbacks=[SignalAt3()], **kw)
try:
    fitter.fit(Classifier(), DictDataset(n=400))
    code = 0
except Preempted as e:
    code = e.code
record["preempted"] = {"step": fitter.state.global_step, **counts, "code": code}
(out / f"votes-rank{rank}.json").write_text(json.dumps(record))

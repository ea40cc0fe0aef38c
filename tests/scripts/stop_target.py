"""A short fit with two DataLoader workers for the preemption tests of tests/checkpoint/test_stop_signals.py.

    python stop_target.py OUT_DIR --hang        # epoch 1's items never load (a hung worker)
    python stop_target.py OUT_DIR --term-at 3   # SIGTERM to itself after step 3

16 items in batches of 4, in order: 4 steps per epoch, a checkpoint every 2 steps in OUT_DIR/run,
12 steps.
``--hang``: once epoch 0 has ended (its workers have read every item by then) every item fetched
sleeps for ever, after writing ``OUT_DIR/hung``: the workers of epoch 1, started after epoch 0's
last step boundary, hang on its first batch, and the loop waits for it with no boundary to come.
``--term-at N``: the stop saves ``checkpoint-N``; once ``fit`` has raised, ``OUT_DIR/fit-ended``
is written and the process exits (its finalization takes seconds here: torch's modules, the
DataLoader's iterator). ``--grace S``: preemption_grace.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import Classifier, DictDataset  # noqa: E402

import lightlike as ll  # noqa: E402


class Hanging(DictDataset):
    def __init__(self, out: str):
        super().__init__(n=16)
        self.armed = os.path.join(out, "armed")
        self.hung = os.path.join(out, "hung")

    def __getitem__(self, i):
        if os.path.exists(self.armed):
            Path(self.hung).write_text(str(os.getpid()))
            time.sleep(10**6)
        return super().__getitem__(i)


class Arm(ll.Callback):
    """Epoch 0's end arms the hang; ``term_at``: SIGTERM to this process after that step."""

    def __init__(self, out: str, hang: bool, term_at: int | None):
        self.out, self.hang, self.term_at = out, hang, term_at

    def on_epoch_end(self, fitter, state, control):
        if self.hang and state.epoch_index == 0:
            Path(self.out, "armed").write_text("")

    def on_step_end(self, fitter, state, control):
        if state.global_step == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--term-at", type=int)
    p.add_argument("--grace", type=float, default=30.0)
    args = p.parse_args()
    fitter = ll.Fitter(max_steps=12, batch_size=4, shuffle=False, num_workers=2, save_every=2,
                       output_dir=os.path.join(args.out, "run"), loggers=[], model_summary=False, log_level="warning",
                       preemption_grace=args.grace, requeue_on_preemption=False,
                       callbacks=[Arm(args.out, args.hang, args.term_at)])
    try:
        fitter.fit(Classifier(), Hanging(args.out))
    finally:
        Path(args.out, "fit-ended").write_text("")


if __name__ == "__main__":
    main()

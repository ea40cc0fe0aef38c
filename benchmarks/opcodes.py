"""Python bytecodes executed per step: the Fitter against the hand-written loop, counted exactly.

The loops are ``benchmarks/overhead.py``'s (tiny MLP, the Fitter's defaults, the hand loop doing
the same work). On a tiny model the Fitter's overhead is the Python it runs between torch calls,
and the wall clock of a shared VM cannot resolve a few microseconds of it (its runs drift by
several per cent), while ``benchmarks/counters.py`` needs hardware counters that this machine
does not always grant. A count of bytecodes is exact and repeats to the instruction: it shows
what a change to the loop removed or added, and where, before the clock is asked whether it
shows. It is not a time: a bytecode that calls into torch costs what torch does.

Counting uses ``sys.settrace`` with ``f_trace_opcodes`` from step ``--warmup`` + 1 to
``--steps`` (both loops), so it runs ~50x slower than the loops themselves; a log step
(``log_every``, default 100) falls inside the window and is included, divided over its steps.

    python benchmarks/opcodes.py                 # totals and the Fitter's 25 busiest functions
    python benchmarks/opcodes.py --lines 40      # the 40 busiest lines of lightlike's code
    python benchmarks/opcodes.py --ops            # torch operators per step instead (on a GPU,
                                                  # each is a kernel launch or more: a proxy for
                                                  # the launch overhead a CPU cannot show)
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Data, hand_written, model_arguments, with_fitter  # noqa: E402


class OpcodeCounter:
    """``mark('start')`` ... ``mark('stop')``: bytecodes executed in between, per code location."""

    def __init__(self, by_line: bool = False):
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.by_line = by_line

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            where = f"{code.co_name}:{frame.f_lineno}" if self.by_line else code.co_name
            self.counts[(_short(code.co_filename), where)] += 1
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return self._local

    def mark(self, what: str) -> None:
        if what == "start":
            self.counts.clear()
            frame = sys._getframe(1)
            while frame is not None:  # the frames already running (the loop itself) count too
                frame.f_trace, frame.f_trace_opcodes = self._local, True
                frame = frame.f_back
            sys.settrace(self._global)
        else:
            sys.settrace(None)
            frame = sys._getframe(1)
            while frame is not None:
                frame.f_trace = None
                frame = frame.f_back


class OpCounter:
    """``mark('start')`` ... ``mark('stop')``: torch operators dispatched in between, by name
    (a ``TorchDispatchMode``: below autograd, so backward's operators count too)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: collections.Counter[tuple[str, str]] = collections.Counter()

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[("aten", str(func.overloadpacket))] += 1
                return func(*args, **(kwargs or {}))

        self.counts, self._mode = counts, Count()

    def mark(self, what: str) -> None:
        if what == "start":
            self.counts.clear()
            self._mode.__enter__()
        else:
            self._mode.__exit__(None, None, None)


def _short(filename: str) -> str:
    for marker in ("site-packages/", "lightlike/", "benchmarks/"):
        if marker in filename:
            head = "" if marker == "site-packages/" else marker
            return head + filename.split(marker, 1)[1]
    return filename


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--steps", type=int, default=500, help="last step; counting covers warmup+1..steps")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--top", type=int, default=25, help="the Fitter's busiest functions to list")
    p.add_argument("--lines", type=int, default=0, help="list this many of lightlike's busiest lines instead")
    p.add_argument("--ops", action="store_true", help="count torch operators, not bytecodes")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = Data(args.samples, args.features)
    steps = args.steps - args.warmup
    hand, fit = (OpCounter(), OpCounter()) if args.ops else (OpcodeCounter(), OpcodeCounter(by_line=args.lines > 0))
    hand_written(data, args, mark=hand.mark)
    with_fitter(data, args, mark=fit.mark)
    h, f = sum(hand.counts.values()) / steps, sum(fit.counts.values()) / steps
    own = sum(n for (file, _), n in fit.counts.items() if file.startswith("lightlike/")) / steps
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, width {args.width}, batch {args.batch_size}, "
          f"steps {args.warmup + 1}..{args.steps} counted")
    unit = "operators" if args.ops else "bytecodes"
    print(f"hand-written, same work : {h:8.1f} {unit}/step")
    print(f"lightlike Fitter        : {f:8.1f} {unit}/step  ({f / h:.3f}" +
          (")" if args.ops else f"; lightlike's own code {own:.1f})"))
    if args.ops:
        both = set(hand.counts) | set(fit.counts)
        rows = [(k, fit.counts[k] - hand.counts[k]) for k in both if fit.counts[k] != hand.counts[k]]
        print("operators the Fitter runs more (+) or fewer (-) times than the hand loop, per step:")
        for (_, name), n in sorted(rows, key=lambda kv: -abs(kv[1]))[:args.top]:
            print(f"  {n / steps:+8.2f}  {name}  (hand {hand.counts[('aten', name)] / steps:.2f})")
        return
    if args.lines:
        rows = [(k, n) for k, n in fit.counts.items() if k[0].startswith("lightlike/")]
        title = f"lightlike's {args.lines} busiest lines (bytecodes/step)"
        limit = args.lines
    else:
        rows, title, limit = list(fit.counts.items()), f"the Fitter's {args.top} busiest functions (bytecodes/step)", args.top
    print(title + ":")
    for (file, where), n in sorted(rows, key=lambda kv: -kv[1])[:limit]:
        print(f"  {n / steps:8.1f}  {file}:{where}")


if __name__ == "__main__":
    main()

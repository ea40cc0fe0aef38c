"""TensorBoard event files, written by the training process itself (tensorboard imported lazily).

Records are TensorBoard's own: its event protos, serialised by its ``RecordWriter`` into a
buffered ``events.out.tfevents.*`` file. torch's ``SummaryWriter`` hands every event to a writer
thread instead; on a training loop that cost 130-210 us per log call here, against ~45 us
written in place (the thread and the loop take turns holding the GIL, and on a multi-process
run the thread competes with the ranks for the cores; see benchmarks/RESULTS.md). The file is
flushed at most every ``flush_secs``, at every checkpoint (``flush``), and at ``finalize``, so
that a run killed after a checkpoint has every step up to that checkpoint on disk.

The event file is created on the first write, so that ``resume(step)`` (called before any
write) can open it with a purge marker at ``step + 1``. TensorBoard then discards every event of
an earlier file whose step is ``>= step + 1``: a resumed run shows each step once, with the
values of the resumed run.

``log_hyperparams`` writes the config twice, at the step the run (or its resumed part) starts
from: as a text table (the TEXT tab) and as the hparams plugin's session start info (the
HPARAMS tab, next to the other runs of the logdir).
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any

from lightlike.loggers.base import Logger
from lightlike.loggers.params import flat_params

INSTALL_HINT = "pip install 'lightlike[tensorboard]'"
_file_ids = itertools.count()


def _import_protos() -> Any:
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as e:
        raise ImportError(f"the TensorBoard logger needs the tensorboard package: {INSTALL_HINT}") from e
    return event_pb2, summary_pb2, RecordWriter


def _cell(value: Any) -> str:
    """A value as one markdown table cell: any type, pipes and newlines escaped."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # a broken __repr__ must not break logging
        text = f"<{type(value).__name__}>"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def hparams_summary(params: dict[str, Any]) -> Any:
    """The HPARAMS tab's record of this run: the hparams plugin's session start info (its own
    ``hparams_pb``), the config flattened to bool, number and string values. No experiment
    summary is written: without one, TensorBoard builds the tab from every run's session start
    info under its logdir and takes each run's scalars (``train/loss``, ``val/...``) as the metric
    columns. An experiment summary would fix the metrics before any is logged, and where several
    runs share a logdir TensorBoard would show one run's summary and hide the other runs' hparams."""
    from tensorboard.plugins.hparams.summary_v2 import hparams_pb

    return hparams_pb(flat_params(params))


class TensorBoardLogger(Logger):
    """Scalars (one event per log call) and text under ``log_dir``."""

    def __init__(self, log_dir: str | Path, flush_secs: float = 5.0) -> None:
        self._event_pb2, self._summary_pb2, self._record_writer_cls = _import_protos()  # fail here, not at the first log
        self.log_dir = str(log_dir)
        self.flush_secs = flush_secs
        self._pending_purge: int | None = None  # purge step for the next file opened
        self._start_step = 0  # the first step this logger writes (resume step + 1)
        self._file: Any = None
        self._records: Any = None
        self._last_flush = 0.0

    def _write(self, step: int, **fields: Any) -> None:
        """One event record; opens the file (with the pending purge marker) on first use."""
        event_pb2 = self._event_pb2
        if self._file is None:
            os.makedirs(self.log_dir, exist_ok=True)
            while True:  # a fresh name: TensorBoard reads every events file in the directory, in name order,
                # so names sort in the order they were opened (nanoseconds: a run resumed in the same second
                # as the one it replaces, whose counter or PID has another number of digits, sorted first
                # and its purge marker never hid the old run's later steps)
                name = f"events.out.tfevents.{time.time_ns():020d}.{socket.gethostname()}.{os.getpid()}.{next(_file_ids)}"
                try:
                    self._file = open(os.path.join(self.log_dir, name), "xb")  # noqa: SIM115  (closed in finalize)
                    break
                except FileExistsError:
                    continue
            self._records = self._record_writer_cls(self._file)
            self._records.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            if self._pending_purge is not None:  # what torch's SummaryWriter(purge_step=...) writes, twice:
                # the server's Python reader (--load_fast=false, the plugin accumulator) takes the first START
                # of a run for its beginning and purges only at a later one; the Rust reader and the
                # EventAccumulator purge at each (a second purge at the same step is a no-op)
                marker = event_pb2.Event(wall_time=time.time(), step=self._pending_purge, session_log=event_pb2.SessionLog(
                    status=event_pb2.SessionLog.START)).SerializeToString()
                self._records.write(marker)
                self._records.write(marker)
                self._pending_purge = None  # applied once: a file reopened later must not purge again
            self._last_flush = time.monotonic()
        self._records.write(event_pb2.Event(wall_time=time.time(), step=int(step), **fields).SerializeToString())
        if time.monotonic() - self._last_flush > self.flush_secs:
            self.flush()

    def last_written_ns(self) -> int | None:
        """When an event file of ``log_dir`` was last opened or written (``build_loggers`` compares
        it with the resumes since): the latest of the files' modification times and, for this
        logger's files, the nanoseconds in their names (a coarse file system clock aside)."""
        try:
            names = [n for n in os.listdir(self.log_dir) if n.startswith("events.out.tfevents.")]
        except OSError:
            return None
        times = []
        for name in names:
            try:
                times.append(os.stat(os.path.join(self.log_dir, name)).st_mtime_ns)
            except OSError:
                continue
            stamp = name.split(".")[3]
            if len(stamp) == 20 and stamp.isdigit():  # opened at that time_ns() (see _write)
                times.append(int(stamp))
        return max(times, default=None)

    def resume(self, step: int) -> None:
        # a file already open (logging before resume) is closed: the next write opens a new
        # event file whose purge marker hides what the old one wrote after ``step``
        self.finalize()
        self._pending_purge = self._start_step = int(step) + 1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # one Summary event holding every scalar of this step (what add_scalar writes, without
        # one event per scalar); NaN/inf are stored as they are
        value = self._summary_pb2.Summary.Value
        self._write(step, summary=self._summary_pb2.Summary(
            value=[value(tag=str(k), simple_value=float(v)) for k, v in metrics.items()]))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        # text at the step this segment of the run starts from: 0 for a fresh run, step + 1
        # after resume(step). A resumed run's config then neither duplicates the first run's
        # (step 0) nor survives a later purge of the steps it belongs to.
        rows = "\n".join(f"| {_cell(k)} | {_cell(v)} |" for k, v in sorted(params.items(), key=lambda kv: str(kv[0])))
        self.log_text("config", "| key | value |\n|---|---|\n" + rows, self._start_step)
        self._write(self._start_step, summary=hparams_summary(params))
        self.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text as text_summary  # the text plugin's format

        self._write(step, summary=text_summary(tag, text))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._last_flush = time.monotonic()

    def finalize(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._records = None


__all__ = ["INSTALL_HINT", "TensorBoardLogger"]

"""TensorBoard event files through torch's ``SummaryWriter`` (imported lazily).

The writer, and with it the event file, is created on the first write, so that ``resume(step)``
(called before any write) can create it with ``purge_step=step + 1``. TensorBoard then discards
every event of an earlier file whose step is ``>= step + 1``: a resumed run shows each step
once, with the values of the resumed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightlike.loggers.base import Logger

INSTALL_HINT = "pip install 'lightlike[tensorboard]'"


def _import_summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises ImportError when tensorboard is missing or too old
        raise ImportError(f"the TensorBoard logger needs the tensorboard package: {INSTALL_HINT}") from e
    return SummaryWriter


def _cell(value: Any) -> str:
    """A value as one markdown table cell: any type, pipes and newlines escaped."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # a broken __repr__ must not break logging
        text = f"<{type(value).__name__}>"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


class TensorBoardLogger(Logger):
    """Scalars (one event per log call) and text under ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        self._summary_writer_cls = _import_summary_writer()  # fail here, not at the first log
        self.log_dir = str(log_dir)
        self._pending_purge: int | None = None  # purge_step for the next writer created
        self._start_step = 0  # the first step this logger writes (resume step + 1)
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter``, created (with the pending purge step) on first use."""
        if self._writer is None:
            self._writer = self._summary_writer_cls(self.log_dir, purge_step=self._pending_purge)
            self._pending_purge = None  # applied once: a writer reopened later must not purge again
        return self._writer

    def resume(self, step: int) -> None:
        # a writer already open (logging before resume) is closed: the next write opens a new
        # event file whose purge marker hides what the old one wrote after ``step``
        self.finalize()
        self._pending_purge = self._start_step = int(step) + 1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # one Summary event holding every scalar of this step (what add_scalar writes, without
        # one event per scalar); NaN/inf are stored as they are
        summary = Summary(value=[Summary.Value(tag=str(k), simple_value=float(v)) for k, v in metrics.items()])
        self.writer._get_file_writer().add_summary(summary, int(step))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        # text at the step this segment of the run starts from: 0 for a fresh run, step + 1
        # after resume(step). A resumed run's config then neither duplicates the first run's
        # (step 0) nor survives a later purge of the steps it belongs to.
        rows = "\n".join(f"| {_cell(k)} | {_cell(v)} |" for k, v in sorted(params.items(), key=lambda kv: str(kv[0])))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + rows, self._start_step)
        self.writer.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, int(step))

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


__all__ = ["INSTALL_HINT", "TensorBoardLogger"]

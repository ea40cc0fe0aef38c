"""TensorBoard event files through tensorboard's own writer (imported on first use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightlike.loggers.base import Logger


class TensorBoardLogger(Logger):
    """Scalars under ``log_dir``. ``resume(step)`` makes the writer purge events after ``step``
    (TensorBoard's ``purge_step``), so a resumed run shows each step once."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise ImportError("the TensorBoard logger needs tensorboard: pip install 'lightlike[tensorboard]'") from e
        self.log_dir = str(log_dir)
        self._purge_step: int | None = None
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, purge_step=self._purge_step)
        return self._writer

    def resume(self, step: int) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._purge_step = step + 1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # one Summary event holding every scalar of this step, through the writer's own event
        # file (add_scalar would build and queue one event per scalar: ~4x the cost)
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()])
        self.writer._get_file_writer().add_summary(summary, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        rows = "\n".join(f"| {k} | {v!r} |" for k, v in sorted(params.items()))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + rows, 0)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

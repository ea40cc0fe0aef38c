"""A tqdm progress bar; off when the stream is not a terminal (unless forced)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lightlike.callbacks.base import Callback

if TYPE_CHECKING:
    from lightlike.fitter import Fitter
    from lightlike.state import Control, FitState


class ProgressBar(Callback):
    """One bar over optimizer steps. It never reads a tensor: the postfix shows the numbers of
    the last log step, so the bar costs no host-device synchronisation."""

    def __init__(self, enabled: bool | None = None, file: Any = None) -> None:
        self.file = file
        self.enabled = enabled
        self.bar: Any = None

    def active(self) -> bool:
        stream = self.file if self.file is not None else sys.stderr
        if self.enabled is None:
            return bool(getattr(stream, "isatty", lambda: False)())
        return self.enabled

    def on_fit_start(self, fitter: Fitter, state: FitState, control: Control) -> None:
        if not self.active():
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, unit="step", dynamic_ncols=True,
                        file=self.file if self.file is not None else sys.stderr, desc="fit")

    def on_step_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            shown = {k.split("/")[-1]: f"{v:.4g}" for k, v in metrics.items() if k in ("train/loss", "train/lr")}
            self.bar.set_postfix(shown, refresh=False)

    def on_evaluate(self, fitter: Fitter, state: FitState, control: Control, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            text = "  ".join(f"{k}={v:.4g}" for k, v in metrics.items())
            self.bar.write(f"step {state.global_step}: {text}", file=self.bar.fp)

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_fit_end(self, fitter: Fitter, state: FitState, control: Control) -> None:
        self._close()

    def on_exception(self, fitter: Fitter, state: FitState, control: Control, error: BaseException) -> None:
        self._close()

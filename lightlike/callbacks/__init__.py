"""Callbacks: the events, the base class, and the built-in ones."""

from lightlike.callbacks.base import EVENTS, Callback, CallbackList
from lightlike.callbacks.early_stopping import EarlyStopping

__all__ = ["EVENTS", "Callback", "CallbackList", "EarlyStopping"]


def __getattr__(name: str):  # ProgressBar imports tqdm lazily; keep it off the import path
    if name == "ProgressBar":
        from lightlike.callbacks.progress import ProgressBar

        return ProgressBar
    raise AttributeError(name)

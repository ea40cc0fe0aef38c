"""Errors lightlike raises. Each message names what to change."""


class LightlikeError(Exception):
    """Base class of lightlike's own errors."""


def on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank at the same point, after the ranks agreed on its
    cause (from gathered values): the ranks are still in step, so a caller may catch it and go
    on, and teardown still waits for every rank before it destroys the process group."""
    error.on_every_rank = True  # type: ignore[attr-defined]
    return error


class ConfigError(LightlikeError, ValueError):
    """A setting is invalid; the message names the setting and the valid choices. ``settings``
    names the ``FitConfig`` fields the check read, where it is one (the command line then says
    which config file set them)."""

    def __init__(self, message: str, *, settings: tuple[str, ...] = ()):
        super().__init__(message)
        self.settings = settings


class DataError(LightlikeError, ValueError):
    """The data or a batch is not usable (empty dataset, missing key, ...)."""


class ModuleContractError(LightlikeError, TypeError):
    """A TaskModule hook returned something the Fitter cannot use."""


class NonFiniteLossError(LightlikeError, FloatingPointError):
    """A training loss was NaN or infinite."""

    def __init__(self, step: int, micro_batch: int, value: float | None = None, items: float | None = None):
        self.step = step
        self.micro_batch = micro_batch
        v = f" ({value})" if value is not None else ""
        if items == 0:  # a mean over no items is 0/0, whatever the model does
            hint = ("That micro-batch holds 0 items (num_items): its mean loss is 0/0. Make loss() return 0 "
                    "for a batch without items, e.g. loss_sum / max(num_items, 1).")
        else:
            hint = ("Lower learning_rate, set max_grad_norm, check the data, or pass nonfinite_loss='skip' "
                    "to skip and count such steps.")
        super().__init__(
            f"non-finite training loss{v} at optimizer step {step}, micro-batch {micro_batch} "
            f"of its accumulation window. {hint}"
        )


class CheckpointError(LightlikeError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the module. ``offers``: the
    settings the message offers, as ``OutputDirError``'s."""

    def __init__(self, message: str, *, offers: tuple[str, ...] = ()):
        super().__init__(message)
        self.offers = offers


class OutputDirError(LightlikeError, FileExistsError):
    """output_dir already holds a run and overwriting was not allowed. ``offers`` lists the
    settings the message offers (``"resume=True"``, ``"resume='auto'"``,
    ``"overwrite_output_dir=True"``), for the command line to name its own flags."""

    def __init__(self, message: str, *, offers: tuple[str, ...] = ()):
        super().__init__(message)
        self.offers = offers

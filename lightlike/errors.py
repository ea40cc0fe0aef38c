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


class CallbackReturnError(LightlikeError, TypeError):
    """A callback's handler returned something other than None, a ``Control``, or a mapping of
    ``Control``'s flag names to True/False (the message names the callback, the event and, for
    a mapping, the flag)."""


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


class NonFiniteGradientError(NonFiniteLossError):
    """The training loss was finite but the global norm of its gradient was NaN or infinite
    (an operation whose derivative is infinite where it was evaluated: ``sqrt`` or a fractional
    power at 0, ``log`` at 0, a norm of a zero vector). A ``NonFiniteLossError``, so code that
    catches non-finite losses catches it too; ``micro_batch`` is None (the norm is the step's)."""

    def __init__(self, step: int, value: float | None = None):
        self.step = step
        self.micro_batch = None  # type: ignore[assignment]
        LightlikeError.__init__(
            self,
            f"non-finite gradient at optimizer step {step}: the global gradient norm was "
            f"{value if value is not None else 'not finite'} "
            "while this process's training loss was finite (on several processes, one rank's NaN/inf reaches "
            "every rank's reduced gradient). An operation whose derivative is infinite at the values it saw (sqrt "
            "or a fractional power at 0, log at 0, a division by 0, the norm of a zero vector) gives a finite "
            "loss a NaN/inf gradient: torch.autograd.set_detect_anomaly(True) names it; keep its input away from "
            "0 (e.g. sqrt(x + 1e-12)), or pass nonfinite_loss='skip' to skip and count such steps."
        )


class AllStepsSkippedError(NonFiniteLossError):
    """Every optimizer step of a fit was skipped (non-finite losses or gradients under
    ``nonfinite_loss="skip"``, loss-scale overflows under float16): the weights are the ones the
    fit started from, which is no success. ``steps``: the fit's steps; ``causes``: how many were
    skipped for each cause ("loss", "gradient", "overflow")."""

    def __init__(self, steps: int, causes: dict[str, int]):
        self.step, self.micro_batch = steps, None  # type: ignore[assignment]
        self.steps, self.causes = steps, dict(causes)
        names = {"loss": "non-finite loss", "gradient": "non-finite gradient", "overflow": "loss-scale overflow"}
        counts = ", ".join(f"{names[k]}: {n}" for k, n in causes.items() if n)
        hints = []
        if causes.get("loss") or causes.get("gradient"):
            hints.append("every step's loss or gradient was NaN/inf: check the data and the loss (pass "
                         "nonfinite_loss='raise' to stop at the first one, named by step)")
        if causes.get("overflow"):
            hints.append("under float16 the loss scaler skips a step whose gradients hold inf/NaN and lowers "
                         "its scale; one that is NaN at any scale (sqrt or log at 0 in the loss) is skipped on "
                         "every step: check the loss, lower the initial scale (MixedPrecision(init_scale=...); DeepSpeed: "
                         "fp16.initial_scale_power), or use 'bf16-mixed'")
        advice = "; ".join(hints)
        LightlikeError.__init__(
            self,
            f"all {steps} optimizer steps of this fit were skipped ({counts}): the weights are the ones the fit "
            f"started from. {advice[:1].upper()}{advice[1:]}."
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

"""lightlike: a PyTorch training framework with an explicit loop, exact and tested."""

from lightlike.callbacks import Callback, EarlyStopping
from lightlike.config import FitConfig
from lightlike.errors import (
    AllStepsSkippedError,
    CallbackReturnError,
    CheckpointError,
    ConfigError,
    DataError,
    LightlikeError,
    ModuleContractError,
    NonFiniteGradientError,
    NonFiniteLossError,
    OutputDirError,
)
from lightlike.fitter import Fitter
from lightlike.module import TaskModule
from lightlike.precision import Precision, get_precision
from lightlike.state import Control, FitResult, FitState, PredictionResult
from lightlike.step import StepContext
from lightlike.strategies import SingleDeviceStrategy, Strategy, get_strategy
from lightlike.utils.seed import seed_everything

__version__ = "0.1.0"

__all__ = [
    "AllStepsSkippedError",
    "Callback",
    "CallbackReturnError",
    "CheckpointError",
    "ConfigError",
    "Control",
    "DataError",
    "EarlyStopping",
    "FitConfig",
    "FitResult",
    "FitState",
    "Fitter",
    "LightlikeError",
    "ModuleContractError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "OutputDirError",
    "Precision",
    "PredictionResult",
    "SingleDeviceStrategy",
    "StepContext",
    "Strategy",
    "TaskModule",
    "get_precision",
    "get_strategy",
    "seed_everything",
]

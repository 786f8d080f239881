"""dream_trainer: Lightning's structure for PyTorch training, without its per-step cost.

Every callback class of `dream_trainer.callbacks` is importable from here too
(`from dream_trainer import EarlyStopping`). Those beyond `Callback` and `ModelCheckpoint` are taken from
`dream_trainer.callbacks` on first use (the module `__getattr__` below): `import dream_trainer` imports
nothing for them.
"""

from typing import TYPE_CHECKING, Any

import dream_trainer._torch_version  # noqa: F401  (first: an older torch fails here, saying what to install)
from dream_trainer.callbacks.base import Callback
from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint
from dream_trainer.config import DreamTrainerConfig
from dream_trainer.datamodule import DataModule
from dream_trainer.errors import (
    CallbackHookError,
    CheckpointError,
    ConfigError,
    DreamTrainerError,
    MisconfigurationError,
    NonFiniteGradientError,
    TrainingInterrupted,
)
from dream_trainer.fault_tolerance import FaultToleranceConfig
from dream_trainer.loggers.base import Logger, MemoryLogger
from dream_trainer.mirror import MirrorConfig
from dream_trainer.protocol import TrainerProtocol
from dream_trainer.registry import Registry, RegistryError, build_from_cfg
from dream_trainer.trainer import DreamTrainer
from dream_trainer.utils.seed import seed_everything

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers and editors
    from dream_trainer.callbacks import (
        EMA,
        BackboneFinetuning,
        BaseFinetuning,
        BasePredictionWriter,
        DeviceStatsMonitor,
        EarlyStopping,
        GarbageCollection,
        GradientNormMonitor,
        LambdaCallback,
        LearningRateMonitor,
        ModelSummary,
        PredictionWriter,
        Profiler,
        ProgressBarBase,
        RichProgressBar,
        StochasticWeightAveraging,
        TextProgress,
        ThroughputMonitor,
        Timer,
        WeightAveraging,
    )

__version__ = "0.1.0"

# The callback classes of `dream_trainer.callbacks.__all__` not imported above: `__getattr__` loads them.
# tests/test_top_level_imports.py keeps this in step with that list.
_LAZY_CALLBACKS = (
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "DeviceStatsMonitor",
    "EMA",
    "EarlyStopping",
    "GarbageCollection",
    "GradientNormMonitor",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelSummary",
    "PredictionWriter",
    "Profiler",
    "ProgressBarBase",
    "RichProgressBar",
    "StochasticWeightAveraging",
    "TextProgress",
    "ThroughputMonitor",
    "Timer",
    "WeightAveraging",
)

__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "Callback",
    "CallbackHookError",
    "CheckpointError",
    "ConfigError",
    "DataModule",
    "DeviceStatsMonitor",
    "DreamTrainer",
    "DreamTrainerConfig",
    "DreamTrainerError",
    "EMA",
    "EarlyStopping",
    "FaultToleranceConfig",
    "GarbageCollection",
    "GradientNormMonitor",
    "LambdaCallback",
    "LearningRateMonitor",
    "Logger",
    "MemoryLogger",
    "MirrorConfig",
    "MisconfigurationError",
    "ModelCheckpoint",
    "ModelSummary",
    "NonFiniteGradientError",
    "PredictionWriter",
    "Profiler",
    "ProgressBarBase",
    "Registry",
    "RegistryError",
    "RichProgressBar",
    "StochasticWeightAveraging",
    "TextProgress",
    "ThroughputMonitor",
    "Timer",
    "TrainerProtocol",
    "TrainingInterrupted",
    "WeightAveraging",
    "__version__",
    "build_from_cfg",
    "seed_everything",
]


def __getattr__(name: str) -> Any:
    """A callback class of `dream_trainer.callbacks`, imported on first use and kept in this module."""
    if name in _LAZY_CALLBACKS:
        import dream_trainer.callbacks

        value = getattr(dream_trainer.callbacks, name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_CALLBACKS})

"""dream_trainer: Lightning's structure for PyTorch training, without its per-step cost."""

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
)
from dream_trainer.loggers.base import Logger, MemoryLogger
from dream_trainer.mixins.signals import TrainingInterrupted
from dream_trainer.protocol import TrainerProtocol
from dream_trainer.registry import Registry, RegistryError, build_from_cfg
from dream_trainer.trainer import DreamTrainer
from dream_trainer.utils.seed import seed_everything

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "CallbackHookError",
    "CheckpointError",
    "ConfigError",
    "DataModule",
    "DreamTrainer",
    "DreamTrainerConfig",
    "DreamTrainerError",
    "Logger",
    "MemoryLogger",
    "MisconfigurationError",
    "ModelCheckpoint",
    "NonFiniteGradientError",
    "Registry",
    "RegistryError",
    "TrainerProtocol",
    "TrainingInterrupted",
    "__version__",
    "build_from_cfg",
    "seed_everything",
]

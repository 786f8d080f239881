"""Metric loggers. Only global rank zero writes; every logger of a run shares `trainer.log_dir`.

`MLFlowLogger` and `WandbLogger` are exported lazily: their modules (and `mlflow` / `wandb`, which
those import only when a logger is built) load on first access, so `import dream_trainer` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dream_trainer.loggers.base import Logger, MemoryLogger
from dream_trainer.loggers.csv_logger import CSVLogger
from dream_trainer.loggers.image_file import ImageFileLogger
from dream_trainer.loggers.jsonl import JSONLinesLogger
from dream_trainer.loggers.tensorboard import TensorBoardLogger

if TYPE_CHECKING:
    from dream_trainer.loggers.mlflow import MLFlowLogger
    from dream_trainer.loggers.wandb import WandbLogger

_LAZY = {"MLFlowLogger": "dream_trainer.loggers.mlflow", "WandbLogger": "dream_trainer.loggers.wandb"}

__all__ = [
    "CSVLogger",
    "ImageFileLogger",
    "JSONLinesLogger",
    "Logger",
    "MLFlowLogger",
    "MemoryLogger",
    "TensorBoardLogger",
    "WandbLogger",
]

BUILTINS: tuple[str, ...] = tuple(n for n in __all__ if n != "Logger")
"""The built-in loggers, every public name but the base class: what `dream_trainer.registry.LOGGERS`
names (a config's `"type"`). A logger exported here is registered."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

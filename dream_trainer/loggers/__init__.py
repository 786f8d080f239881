"""Metric loggers. Only global rank zero writes; every logger of a run shares `trainer.log_dir`."""

from dream_trainer.loggers.base import Logger, MemoryLogger
from dream_trainer.loggers.csv_logger import CSVLogger
from dream_trainer.loggers.image_file import ImageFileLogger
from dream_trainer.loggers.jsonl import JSONLinesLogger
from dream_trainer.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "ImageFileLogger", "JSONLinesLogger", "Logger", "MemoryLogger", "TensorBoardLogger"]

BUILTINS: tuple[str, ...] = tuple(n for n in __all__ if n != "Logger")
"""The built-in loggers, every public name but the base class: what `dream_trainer.registry.LOGGERS`
names (a config's `"type"`). A logger exported here is registered."""

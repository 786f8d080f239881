"""Metric loggers. Only global rank zero writes; every logger of a run shares `trainer.log_dir`."""

from dream_trainer.loggers.base import Logger, MemoryLogger
from dream_trainer.loggers.csv_logger import CSVLogger
from dream_trainer.loggers.image_file import ImageFileLogger
from dream_trainer.loggers.jsonl import JSONLinesLogger
from dream_trainer.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "ImageFileLogger", "JSONLinesLogger", "Logger", "MemoryLogger", "TensorBoardLogger"]

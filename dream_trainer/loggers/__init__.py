"""Metric loggers."""

from dream_trainer.loggers.base import Logger, MemoryLogger

__all__ = ["Logger", "MemoryLogger"]

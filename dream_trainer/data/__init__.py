"""Data pipeline: datasets that shard over ranks and workers, samplers, collators."""

from dream_trainer.data.sharding import DataParallelAware

__all__ = ["DataParallelAware"]

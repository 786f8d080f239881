"""Utilities shared by the trainer and usable on their own."""

from dream_trainer.utils.aggregation import MetricAggregator
from dream_trainer.utils.modules import unwrap
from dream_trainer.utils.records import key_average
from dream_trainer.utils.seed import seed_everything
from dream_trainer.utils.tensors import batch_size_of, map_nested_tensor, move_to_device

__all__ = [
    "MetricAggregator",
    "batch_size_of",
    "key_average",
    "map_nested_tensor",
    "move_to_device",
    "seed_everything",
    "unwrap",
]

"""Data pipeline: datasets that shard over ranks and workers, samplers, collators.

- `DataParallelAware`, `shard_indices`: how a dataset or sampler learns its data-parallel rank, and
  which part of the data each (rank, loader worker) reads.
- `ShardedIterable`: base class of a stream of shards with a seeded per-epoch order and an exact resume;
  `ShardList` (webdataset-style shard files) and `TokenDataset` (token files) are built on it.
- `TokenWindows`: the map-style windows of token files.
- `PadCollator`: pads tensors to the longest in the batch, gathers the rest in lists.
- `InfiniteSampler`: seeded passes forever, split over ranks, resumable.
- `GlobalOrderSampler`: an epoch's seeded order, the same over all ranks at every world size (a run
  continues mid-epoch on another number of processes).

The datasets are registered in `dream_trainer.registry.DATASETS` under their class names.
"""

from dream_trainer.data.collate import PadCollator
from dream_trainer.data.samplers import GlobalOrderSampler, InfiniteSampler
from dream_trainer.data.shard_list import ShardList, read_jsonl, read_tar
from dream_trainer.data.sharding import DataParallelAware, shard_indices
from dream_trainer.data.streaming import ShardedIterable
from dream_trainer.data.tokens import TOKEN_DTYPES, TokenDataset, TokenWindows

__all__ = [
    "TOKEN_DTYPES",
    "DataParallelAware",
    "GlobalOrderSampler",
    "InfiniteSampler",
    "PadCollator",
    "ShardList",
    "ShardedIterable",
    "TokenDataset",
    "TokenWindows",
    "read_jsonl",
    "read_tar",
    "shard_indices",
]

BUILTINS: tuple[str, ...] = ("ShardList", "TokenDataset", "TokenWindows")
"""The datasets `dream_trainer.registry.DATASETS` knows by name."""

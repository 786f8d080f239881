"""How the trainer tells a dataset or sampler which data-parallel rank reads it.

A dataset (usually an `IterableDataset` that streams shards) or a sampler that splits its data over
ranks itself inherits `DataParallelAware`. Under a data-parallel strategy the trainer calls
`set_data_parallel(rank, size)` on it before the first epoch, and does not wrap it in a
`DistributedSampler` nor warn about it. Found by type, so no other class answers by accident.
"""

from __future__ import annotations


class DataParallelAware:
    """Mixin for datasets and samplers that split their data over data-parallel ranks themselves."""

    def set_data_parallel(self, rank: int, size: int) -> None:
        """Read the part of the data that belongs to data-parallel `rank` of `size` ranks."""
        raise NotImplementedError(f"{type(self).__name__} must implement set_data_parallel(rank, size)")

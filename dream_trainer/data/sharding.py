"""How the trainer tells a dataset or sampler which data-parallel rank reads it, and which part of the
data each (rank, loader worker) pair reads.

A dataset (usually an `IterableDataset` that streams shards) or a sampler that splits its data over
ranks itself inherits `DataParallelAware`. Under a data-parallel strategy the trainer calls
`set_data_parallel(rank, size)` on it before the first epoch, and does not wrap it in a
`DistributedSampler` nor warn about it. Found by type, so no other class answers by accident.

`shard_indices` is the split itself: item `i` of a pass belongs to rank `i % size`, and within that
rank to worker `(i // size) % num_workers`, so every (rank, worker) reads a disjoint part and the
parts together are the whole pass.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import get_worker_info

__all__ = ["DataParallelAware", "shard_indices"]


class DataParallelAware:
    """Mixin for datasets and samplers that split their data over data-parallel ranks themselves."""

    def set_data_parallel(self, rank: int, size: int) -> None:
        """Read the part of the data that belongs to data-parallel `rank` of `size` ranks."""
        raise NotImplementedError(f"{type(self).__name__} must implement set_data_parallel(rank, size)")


def _worker(worker_info: Any) -> tuple[int, int]:
    """`(worker_id, num_workers)` from a `WorkerInfo`, a `(id, num_workers)` pair, or None (this process:
    the loader worker it is, or the main process)."""
    if worker_info is None:
        worker_info = get_worker_info()
    if worker_info is None:
        return 0, 1
    if isinstance(worker_info, tuple):
        worker_id, num_workers = worker_info
    else:
        worker_id, num_workers = worker_info.id, worker_info.num_workers
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker id {worker_id} is not in 0..{num_workers - 1}")
    return int(worker_id), int(num_workers)


def _check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"data-parallel rank {rank} of size {size}: the rank must be in 0..size-1 and size >= 1")


def shard_indices(n_items: int, rank: int = 0, size: int = 1, worker_info: Any = None, *, even: bool = False) -> range:
    """The items of a pass of `n_items` that data-parallel `rank` of `size`, in loader worker
    `worker_info`, reads.

    `worker_info` is what `torch.utils.data.get_worker_info()` returns, a `(worker_id, num_workers)`
    pair, or None to ask the current process (the main process counts as worker 0 of 1). Every
    (rank, worker) pair gets a disjoint part and together they cover the pass. With `even`, the last
    `n_items % size` items are left out so that every rank reads the same number of items (what
    keeps the ranks of a data-parallel run stepping together); the part of each worker then differs by
    at most one item.

    ```python
    shard_indices(10, rank=1, size=2, worker_info=(0, 2))   # range(1, 10, 4): items 1, 5, 9
    ```
    """
    if n_items < 0:
        raise ValueError(f"n_items must be >= 0, got {n_items}")
    _check_rank(rank, size)
    worker_id, num_workers = _worker(worker_info)
    stop = n_items - n_items % size if even else n_items
    return range(rank + size * worker_id, stop, size * num_workers)

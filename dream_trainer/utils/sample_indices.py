"""The dataset indices of one training batch, worked out again when a batch goes on the skip list.

Nothing is recorded while training (no per-batch cost): the indices are computed from the loader's
sampler when they are asked for, which is rare (a batch is skipped). That works where the order is
reproducible:

- a `DistributedSampler` (the one the trainer gives a loader under data parallelism, or
  `GlobalOrderSampler`): its epoch order comes from its seed and the epoch only, and rank `r` of `W`
  takes positions `r, r + W, ...` of it, so every rank's indices are known on any rank, with no
  collective;
- a `SequentialSampler`: `0, 1, 2, ...`;
- a `RandomSampler` (`shuffle=True`, one process): its order is drawn from the RNG when the epoch's
  iterator starts, and the trainer keeps that RNG state (`LoopState.epoch_rng`, for exact mid-epoch
  resume); the draw is replayed from it and the RNG put back as it was.

Anything else (an `IterableDataset`, a custom sampler or batch sampler, a loader with persistent
workers that does not redraw its base seed each epoch, a loader that is not a `DataLoader`) has no
indices: None.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from dream_trainer.utils.data_resume import capture_epoch_rng, restore_epoch_rng


class _Positions(Dataset[int]):
    """A dataset whose sample `i` is `i`: a loader over it yields the indices its sampler draws."""

    def __getitem__(self, index: int) -> int:
        return int(index)


def batch_sample_indices(
    loader: Any, epoch: int, batch_idx: int, epoch_rng: dict[str, Any] | None, data_parallel_size: int = 1
) -> list[list[int]] | None:
    """The dataset indices of batch `batch_idx` of epoch `epoch`, one list per data-parallel rank (in rank
    order; one list on one process), or None where the sampler cannot say (see the module docstring).
    `epoch_rng`: the RNG state that drew the epoch's order (`LoopState.epoch_rng`; None when unknown or
    of another epoch), needed for a `RandomSampler` only."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batches = loader.batch_sampler
    if type(batches) is not BatchSampler:  # a custom batch sampler: its batches are its own
        return None
    sampler, size, drop_last = batches.sampler, batches.batch_size, batches.drop_last
    if isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__:
        ranks = int(sampler.num_replicas)
        if ranks != data_parallel_size:
            return None
        # The order over all ranks (padded or cut to `total_size` as the sampler does): a copy that is the
        # only replica of it, at the batch's epoch.
        whole = copy.copy(sampler)
        whole.rank, whole.num_replicas, whole.num_samples, whole.epoch = 0, 1, sampler.total_size, epoch
        order = list(whole)
        found = [_batch(order[r::ranks], batch_idx, size, drop_last) for r in range(ranks)]
        return None if any(b is None for b in found) else [b for b in found if b is not None]
    if data_parallel_size != 1:  # the ranks' parts of such an order are not known here
        return None
    if type(sampler) is SequentialSampler:
        one = _batch(range(len(sampler)), batch_idx, size, drop_last)
    elif type(sampler) is RandomSampler and epoch_rng is not None and not loader.persistent_workers:
        one = _replayed(loader, batch_idx, epoch_rng)
    else:
        return None
    return None if one is None else [one]


def _batch(order: Any, batch_idx: int, size: int, drop_last: bool) -> list[int] | None:
    chunk = order[batch_idx * size : (batch_idx + 1) * size]
    if not len(chunk) or (drop_last and len(chunk) < size):
        return None
    return [int(i) for i in chunk]


def _replayed(loader: DataLoader, batch_idx: int, epoch_rng: dict[str, Any]) -> list[int] | None:
    """Batch `batch_idx`'s indices, from the RNG state that drew the epoch's order; the RNG is put back.

    A loader over `_Positions` with the same batch sampler and generator draws what the training loader's
    iterator drew (its base seed, then the sampler's order), in torch's own code, in one process."""
    now = capture_epoch_rng(loader)
    restore_epoch_rng(loader, epoch_rng)
    try:
        replay = DataLoader(
            _Positions(), batch_sampler=loader.batch_sampler, collate_fn=list, generator=loader.generator
        )
        found = next(itertools.islice(iter(replay), batch_idx, None), None)
    finally:
        restore_epoch_rng(loader, now)
    return None if found is None else [int(i) for i in found]

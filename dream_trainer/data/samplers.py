"""Samplers that split a seeded order over data-parallel ranks themselves.

- `InfiniteSampler`: indices for step-based training, one seeded pass after another, split over ranks.
- `GlobalOrderSampler`: one epoch's seeded order over all ranks, the same at every world size, so a run
  can continue mid-epoch on another number of processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler

from dream_trainer.data.sharding import DataParallelAware, _check_rank
from dream_trainer.errors import CheckpointError

__all__ = ["GlobalOrderSampler", "InfiniteSampler"]


class InfiniteSampler(Sampler[int], DataParallelAware):
    """Yields dataset indices forever: pass after pass, each a seeded shuffle (`seed + pass`) of all
    indices, of which data-parallel rank `r` of `size` takes positions `r, r + size, ...`.

    Every index is read once per pass across the ranks. The loader never ends, so the length of
    training is `max_steps`. The sampler remembers where it is: `state_dict()` / `load_state_dict()`
    (which torchdata's `StatefulDataLoader` calls) continue the stream exactly, and a new `iter()`
    continues where the last one stopped. Under data parallelism the trainer calls
    `set_data_parallel(rank, size)`; the trainer is then not adding a `DistributedSampler`.

    ```python
    loader = StatefulDataLoader(dataset, batch_size=32, sampler=InfiniteSampler(dataset, seed=0))
    ```

    Args:
        data_source: the dataset (anything with a length) or the number of items.
        shuffle: a new seeded order for every pass; False reads `0, 1, 2, ...` every pass.
        seed: the seed of the orders, the same on every rank.
    """

    def __init__(self, data_source: Sized | int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_items = data_source if isinstance(data_source, int) else len(data_source)
        if self.num_items < 1:
            raise ValueError(f"InfiniteSampler: the dataset is empty (length {self.num_items}); it needs an item")
        self.shuffle = shuffle
        self.seed = seed
        self._rank = 0
        self._size = 1
        self._epoch = 0
        """The pass the stream is in."""
        self._position = 0
        """Indices of that pass this rank has yielded."""
        self._loaded: dict[str, Any] | None = None
        """The identity a loaded state was saved with, checked at the next `iter()`."""

    def set_data_parallel(self, rank: int, size: int) -> None:
        _check_rank(rank, size)
        if size > self.num_items:
            raise ValueError(
                f"InfiniteSampler: {size} data-parallel ranks for {self.num_items} items; some rank would read nothing"
            )
        self._rank, self._size = rank, size

    def set_epoch(self, epoch: int) -> None:
        """Restart the stream at the beginning of pass `epoch`."""
        self._epoch, self._position = epoch, 0

    def pass_indices(self, epoch: int) -> list[int]:
        """This rank's indices of pass `epoch`, in order."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_items, generator=g)
        else:
            order = torch.arange(self.num_items)
        return order[self._rank :: self._size].tolist()

    def __iter__(self) -> Iterator[int]:
        self._check_loaded()
        return self._generate(self._epoch, self._position)

    def _generate(self, epoch: int, position: int) -> Iterator[int]:
        while True:
            indices = self.pass_indices(epoch)
            for i in range(position, len(indices)):
                self._epoch, self._position = epoch, i + 1
                yield indices[i]
            epoch, position = epoch + 1, 0
            self._epoch, self._position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "rank": self._rank,
            "size": self._size,
            "num_items": self.num_items,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._loaded = dict(state)

    def _check_loaded(self) -> None:
        state, self._loaded = self._loaded, None
        if state is None:
            return
        if (state["rank"], state["size"], state["num_items"]) != (self._rank, self._size, self.num_items):
            raise CheckpointError(
                f"InfiniteSampler: the saved position belongs to data-parallel rank {state['rank']} of {state['size']} "
                f"over {state['num_items']} items, but this run is rank {self._rank} of {self._size} over "
                f"{self.num_items}; resume with the same data-parallel size and dataset"
            )


class GlobalOrderSampler(DistributedSampler[int], DataParallelAware):
    """The epoch order of a `DistributedSampler` (a seeded permutation of `seed + epoch`, or `0, 1, 2, ...`
    unshuffled, of which data-parallel rank `r` of `size` takes positions `r, r + size, ...`), with the
    rank and size set by the trainer instead of read from the process group: on one process too.

    The order over all ranks together does not depend on their number, so a run that shuffles with it
    on one process reads, step after step, the same samples as on several (with the same batch size x
    ranks), and a checkpoint written mid-epoch continues exactly on another number of processes. The
    trainer installs one itself where a run that began under data parallelism (whose shuffling loader
    it gave a `DistributedSampler`) is resumed on one process.

    ```python
    loader = DataLoader(dataset, batch_size=32, sampler=GlobalOrderSampler(dataset, seed=0))
    ```

    Args:
        dataset: the map-style dataset (anything with a length).
        shuffle: a new seeded order every epoch (`set_epoch`, which the trainer calls); False reads
            `0, 1, 2, ...`.
        seed: the seed of the orders, the same on every rank: the trainer's `DistributedSampler` uses
            `config.seed` (0 when None), so the two agree when it is the same.
        drop_last: leave out the last `len(dataset) % size` samples of an epoch's order instead of
            repeating its first ones, so that every rank reads as many.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        # DistributedSampler only reads len(dataset); one process until the trainer says otherwise.
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]

    def set_data_parallel(self, rank: int, size: int) -> None:
        _check_rank(rank, size)
        n = len(self.dataset)  # type: ignore[arg-type]  # a Sized dataset (see __init__)
        self.rank, self.num_replicas = rank, size
        # DistributedSampler's own arithmetic, for the new size.
        self.num_samples = math.ceil((n - size) / size) if self.drop_last and n % size else math.ceil(n / size)
        self.total_size = self.num_samples * size

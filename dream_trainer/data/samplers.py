"""`InfiniteSampler`: indices for step-based training, one seeded pass after another, split over ranks."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from dream_trainer.data.sharding import DataParallelAware, _check_rank
from dream_trainer.errors import CheckpointError

__all__ = ["InfiniteSampler"]


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

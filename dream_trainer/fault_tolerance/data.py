"""The global sample cursor under fault tolerance and the loader that deals each step's samples out by its quorum
(see the package docstring)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dream_trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from dream_trainer.loop_state import LoopState


class Dealer(Protocol):
    """What `QuorumBatches` calls on the `FaultTolerance` object (`replica.py`, which imports this module)."""

    cursor: SampleCursor

    def use_order(self, order: tuple[Any, ...]) -> None: ...
    def start_epoch(self, epoch: int) -> None: ...
    def assign(self, size: int, batch_size: int) -> tuple[int, int, int, int] | None: ...


class SampleCursor:
    """The global sample cursor: the epoch, and how many samples of that epoch's global order the committed
    steps covered. The order over all replica groups is one permutation per epoch (seeded by the run's seed
    and the epoch), so it does not depend on how many groups read it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def order(self, size: int, shuffle: bool, seed: int | None = None) -> torch.Tensor:
        """The epoch's order of the dataset's `size` indices: a `DistributedSampler`'s (and so a
        `GlobalOrderSampler`'s) over all ranks, a permutation seeded by `seed + epoch` (`seed`: the run's)."""
        if not shuffle:
            return torch.arange(size)
        generator = torch.Generator().manual_seed((self.seed if seed is None else seed) + self.epoch)
        return torch.randperm(size, generator=generator)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class QuorumBatches:
    """The training loader under fault tolerance: one batch per step, read from the user's map-style loader's
    dataset at the positions the step's quorum assigns this process (positions start+k, start+k+W, ... of
    the epoch's global order, W the processes taking part). Read in the training process: a step's samples
    are known only after its quorum. Its `state_dict` says only "continue the epoch" (the cursor is the
    `FaultTolerance`'s, saved with it)."""

    def __init__(self, loader: DataLoader[Any], ft: Dealer, loop: LoopState) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size or 1)
        self.collate_fn = loader.collate_fn
        from torch.utils.data import DistributedSampler

        from dream_trainer.utils.data_resume import is_random_sampler

        sampler = loader.sampler
        # A GlobalOrderSampler (a DistributedSampler) keeps its own shuffle and seed; a plain loader's shuffle
        # becomes the run's seeded order.
        self.seed: int | None = sampler.seed if isinstance(sampler, DistributedSampler) else None
        self.shuffle = sampler.shuffle if isinstance(sampler, DistributedSampler) else is_random_sampler(sampler)
        seed = ft.cursor.seed if self.seed is None else self.seed
        ft.use_order(("distributed", seed) if self.shuffle else ("sequential",))  # as `global_order` says it
        self._ft = ft
        self._loop = loop
        self._continue = False

    def state_dict(self) -> dict[str, Any]:
        return {"continue": True}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._continue = bool(state.get("continue"))

    def __iter__(self) -> Iterator[Any]:
        ft = self._ft
        if not self._continue:
            ft.start_epoch(self._loop.epoch)
        self._continue = False
        size = len(self.dataset)  # type: ignore[arg-type]
        order = ft.cursor.order(size, self.shuffle, self.seed)
        while True:
            batch = self.next_batch(order, size)
            if batch is None:
                return
            yield batch

    def next_batch(self, order: torch.Tensor | None = None, size: int | None = None) -> Any:
        """The batch of the coming step (None: the epoch's rest is smaller than one global batch)."""
        ft = self._ft
        if size is None:
            size = len(self.dataset)  # type: ignore[arg-type]
        if order is None:
            order = ft.cursor.order(size, self.shuffle, self.seed)
        where = ft.assign(size, self.batch_size)
        if where is None:
            return None
        _, end, first, stride = where
        indices = order[first:end:stride].tolist()
        return self.collate_fn([self.dataset[i] for i in indices])


def check_loader(loader: Any) -> None:
    """Fault tolerance reads a map-style `DataLoader` itself; anything else is refused, naming what to use."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise MisconfigurationError(
            "fault_tolerance needs the training loader to be a torch DataLoader over a map-style dataset (with "
            f"__len__ and __getitem__), got {type(loader).__name__}: each step's samples are dealt out by its quorum "
            "from one global order."
        )
    if loader.batch_size is None:
        raise MisconfigurationError(
            "fault_tolerance needs the training DataLoader's batch_size (a batch_sampler is not read under it)."
        )

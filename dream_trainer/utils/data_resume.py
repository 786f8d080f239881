"""Exact mid-epoch resume for data loaders.

A shuffling `DataLoader` draws its permutation (and its workers' base seed) from torch's global RNG
or from its generator when the epoch's iterator starts. The trainer snapshots those RNG sources at
the start of every epoch; to resume after `k` batches it restores the snapshot, rebuilds the loader
around a batch sampler that drops the first `k` batches of *indices* (no sample is read), and the
iterator then yields exactly the batches the uninterrupted run would have seen.

Loaders with their own `state_dict()` (torchdata's `StatefulDataLoader`) are restored from it, except
over a map-style dataset whose order over all ranks is known (`global_order`): there the batches done
are the position, which another number of ranks can continue too (see `dream_trainer.utils.data_reshard`).
Iterable-style datasets have no index to skip to: the epoch restarts, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from dream_trainer.utils.data import loader_settings
from dream_trainer.utils.warn import warn_user


def _generators(loader: Any) -> list[torch.Generator]:
    """The distinct generators a loader draws from (its own, its sampler's, its batch sampler's)."""
    found: list[torch.Generator] = []
    holders = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    holders.append(getattr(holders[2], "sampler", None))
    for holder in holders:
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def has_own_state(loader: Any) -> bool:
    """True for loaders that save and restore their position themselves (StatefulDataLoader)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def capture_epoch_rng(loader: Any) -> dict[str, Any]:
    """RNG states that decide an epoch's order; take it right before `iter(loader)`."""
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in _generators(loader)]}


def is_random_sampler(sampler: Any) -> bool:
    """The sampler of a `shuffle=True` loader: torch's `RandomSampler`, or the stateful one torchdata's
    `StatefulDataLoader` makes instead (same name, not a subclass)."""
    from torch.utils.data import RandomSampler

    return isinstance(sampler, RandomSampler) or type(sampler).__name__ == "RandomSampler"


def keeps_own_position(loader: Any) -> bool:
    """True when the loader's own `state_dict()` is its place in the epoch (a StatefulDataLoader over a
    stream, or with a sampler whose order the trainer cannot rebuild). A map-style loader whose order over
    all ranks is known (`global_order`) is placed by the batches done instead, stateful or not: that
    position any number of ranks can continue, and it never depends on which loader object was iterated.
    (A stream keeps its own state too: on the same ranks it continues without reading the samples before
    its place again; on others the global sample cursor places it, `continues_stream`.)"""
    if not has_own_state(loader):
        return False
    order = global_order(loader)
    return order is None or order[0] == "stream"


def keep_stream_parts(loader: Any, order: tuple[Any, ...] | None) -> None:
    """Where a checkpoint's training order `order` is a stream's read as parts (`ShardedIterable.global_order`
    with the parts appended) and this loader reads the same stream, read it as those parts too: the run
    continues with the parts of its start at any number of ranks (`dream_trainer.data.parts`)."""
    from dream_trainer.data.streaming import ShardedIterable

    dataset = getattr(loader, "dataset", None)
    if order is None or len(order) < 5 or order[0] != "stream" or not isinstance(dataset, ShardedIterable):
        return
    if type(dataset).__qualname__ == order[1]:
        dataset.read_as_parts(int(order[4]))


def restore_epoch_rng(loader: Any, state: dict[str, Any] | None) -> None:
    if state is None:  # a checkpoint of a loader that kept its own state; its order needs no RNG (global_order)
        return
    torch.set_rng_state(state["torch"])
    gens = _generators(loader)
    if len(gens) != len(state["generators"]):
        raise ValueError(
            f"the training loader draws from {len(gens)} generator(s) but the checkpoint saved "
            f"{len(state['generators'])}: was the loader built differently?"
        )
    for g, s in zip(gens, state["generators"], strict=True):
        g.set_state(s)


class SkipBatches:
    """A (batch) sampler that draws everything its inner sampler draws but drops the first `skip`."""

    def __init__(self, inner: Iterable[Any], skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        for _ in range(self.skip):
            if next(it, _END) is _END:
                return
        yield from it

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)  # type: ignore[arg-type]  # sized loaders only reach here


_END = object()


def _rebuilt(loader: DataLoader, skip: int) -> DataLoader:
    common = loader_settings(loader)
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=SkipBatches(loader.batch_sampler, skip), **common)
    # batch_size=None: the sampler yields one batch index at a time.
    return DataLoader(loader.dataset, batch_size=None, sampler=SkipBatches(loader.sampler, skip), **common)


def resumed_iterator(loader: Any, skip: int, epoch_rng: dict[str, Any], loader_state: Any) -> tuple[Iterator[Any], int]:
    """An iterator over the rest of an epoch of which `skip` batches were done, and the index of the
    first batch it yields (0 when the epoch has to restart)."""
    if loader_state is not None and has_own_state(loader):
        loader.load_state_dict(loader_state)
        return iter(loader), skip
    if isinstance(loader, DataLoader):
        if continues_stream(loader):  # placed by the cursor: this rank's part starts after its done batches
            stream: Any = loader.dataset  # a ShardedIterable (`_stream_order`)
            stream.continue_part_at(skip * int(loader.batch_size or 1))
            it = iter(loader)  # (its worker, if any, has its copy of the dataset now)
            stream.forget_position()
            return it, skip
        if isinstance(loader.dataset, IterableDataset):
            warn_user(
                f"resuming at the start of the epoch: the training loader reads an IterableDataset, which "
                f"cannot skip to batch {skip}, so the {skip} batches done before the checkpoint are seen "
                "again. Use a map-style dataset, or a loader with state_dict() (torchdata's "
                "StatefulDataLoader), for an exact resume.",
            )
            return iter(loader), 0
        restore_epoch_rng(loader, epoch_rng)
        return iter(_rebuilt(loader, skip)), skip
    # Any other iterable: replay the same RNG and step over the done batches (they are read).
    restore_epoch_rng(loader, epoch_rng)
    it = iter(loader)
    for _ in range(skip):
        if next(it, _END) is _END:
            break
    return it, skip


def global_order(loader: Any) -> tuple[Any, ...] | None:
    """What decides the order of samples over all data-parallel ranks together, when it does not depend
    on the number of ranks: `("sequential",)` for an unshuffled loader (a `DistributedSampler` without
    shuffle deals the same sequence out), `("distributed", seed)` for a shuffling `DistributedSampler`
    (its permutation comes from seed and epoch only), `("stream", ...)` for a `ShardedIterable` read in one
    process per rank (`_stream_order`). None for anything else: its order depends
    on the ranks, the loader workers, the global RNG or the loader's own state."""
    from torch.utils.data import DistributedSampler, SequentialSampler

    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return None
    if isinstance(loader.dataset, IterableDataset):
        return _stream_order(loader)
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return ("sequential",)
    if isinstance(sampler, DistributedSampler):
        return ("distributed", sampler.seed) if sampler.shuffle else ("sequential",)
    return None


def _stream_order(loader: DataLoader) -> tuple[Any, ...] | None:
    """A `ShardedIterable`, each rank reading it in one process (`num_workers` 0 or 1): `("stream", class,
    seed or None, shards[, parts])` (see `ShardedIterable.global_order`). More workers deal each rank's part out
    over them, so a step's samples depend on workers x ranks: None, as for other streams."""
    from dream_trainer.data.streaming import ShardedIterable

    if not isinstance(loader.dataset, ShardedIterable) or loader.num_workers > 1:
        return None
    return loader.dataset.global_order()


def continues_stream(loader: Any) -> bool:
    """The training loader reads a stream that a global sample cursor places (`_stream_order`)."""
    stream = isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset)
    return stream and global_order(loader) is not None


def order_source(loader: Any) -> str:
    """What decides the order of a loader's samples, by class name (for messages): the stream's dataset,
    the sampler, a custom batch sampler, or the loader itself when it is not a DataLoader."""
    if not isinstance(loader, DataLoader):
        return type(loader).__name__
    if isinstance(loader.dataset, IterableDataset):
        return type(loader.dataset).__name__
    if loader.batch_size is None:
        return type(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler).__name__
    return type(loader.sampler).__name__


def samples_per_step(loader: Any, data_parallel_size: int) -> int | None:
    """Samples one batch of every data-parallel rank covers together (None when unknown)."""
    size = getattr(loader, "batch_size", None)
    return size * data_parallel_size if isinstance(size, int) else None


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's samplers and its dataset which epoch starts (`set_epoch(epoch)`, the convention of
    `DistributedSampler`, HuggingFace datasets and webdataset-style streams), so each epoch reshuffles."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    seen: list[Any] = []
    for holder in (*holders, getattr(loader, "dataset", None)):
        if holder is not None and all(holder is not s for s in seen) and callable(getattr(holder, "set_epoch", None)):
            seen.append(holder)
            holder.set_epoch(epoch)

"""Data helpers: batch limits, and the loader a custom `training_loop()` iterates."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from dream_trainer.errors import ConfigError


def loader_length(loader: Iterable[Any]) -> int | None:
    """`len(loader)`, or None for iterables without a length."""
    try:
        return len(loader)  # type: ignore[arg-type]  # TypeError is the answer for no length
    except TypeError:
        return None


def release_workers(iterator: Any) -> None:
    """Stop the worker processes of a loader iterator the trainer is done with, now (torch's own
    shutdown; a no-op for one without workers, one already exhausted, and persistent workers, which
    the loader keeps for its next epoch on purpose).

    An iterator left before its end (`max_steps`, `should_stop`, `limit_*_batches`, an exception)
    keeps its workers until it is freed. A trainer is freed by Python's cyclic garbage collector,
    and so is a `StatefulDataLoader`'s iterator, which the loader keeps for `state_dict()`: torch's
    shutdown run from there waits out its 5-second timeout for every worker before killing it. The
    iterator's position stays readable afterwards (`StatefulDataLoader.state_dict()` asks no worker)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None and not getattr(iterator, "_persistent_workers", False):
        shutdown()


def stop_persistent_workers(loader: Any) -> None:
    """Stop the worker processes a loader with `persistent_workers=True` keeps between epochs, now: at the
    exit of a distributed run, while the loader's queues still work (a no-op for any other loader).

    That exit frees the trainers with Python's cyclic garbage collector (`_destroy_process_group`), and the
    loaders and their iterators with them. Torch's shutdown, run from there, waited out its 5-second timeout
    for every worker: the stop message it queues for each never arrived (the queue's sending thread was
    gone by then), so a DDP job with 2 persistent workers per rank took 10 s longer to end. The loader is
    not used again: its iterator stays, shut down."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and getattr(iterator, "_persistent_workers", False):
        release = getattr(iterator, "_shutdown_workers", None)
        if release is not None:
            release()


def releasing(iterator: Any, batches: Iterable[Any]) -> Iterator[Any]:
    """`batches` (read from `iterator`), then `release_workers(iterator)`, also when left early."""
    try:
        yield from batches
    finally:
        release_workers(iterator)


def limited_length(loader: Iterable[Any], limit: int | float | None, setting: str) -> int | None:
    """Batches to take from `loader` given a `limit_*_batches` setting (None: unknown length)."""
    n = loader_length(loader)
    if limit is None:
        return n
    if isinstance(limit, float):
        if n is None:
            raise ConfigError(
                f"config.{setting} = {limit!r} is a fraction, but the loader has no length; "
                "use an int number of batches instead."
            )
        return max(1, int(n * limit)) if limit > 0 else 0
    return limit if n is None else min(n, limit)


class EpochSource(Protocol):
    """What `EpochLoader` iterates and measures: the trainer's epoch (utils know no trainer class)."""

    @property
    def num_training_batches(self) -> int | None: ...

    def iter_train_epoch(self) -> Iterator[tuple[int, Any]]: ...


class EpochLoader:
    """`trainer.train_loader`: the user's loader, iterated as one training epoch.

    Iterating it fires the epoch hooks and applies `limit_train_batches`, so a custom
    `training_loop()` that writes `for batch_idx, batch in enumerate(self.train_loader)` keeps
    `current_epoch`, accumulation windows and the epoch hooks right. `on_train_epoch_end` fires when
    the loader is exhausted. Attributes (`dataset`, `batch_size`, ...) are the wrapped loader's.
    """

    def __init__(self, trainer: EpochSource, loader: Iterable[Any]) -> None:
        self._trainer = trainer
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        for _, batch in self._trainer.iter_train_epoch():
            yield batch

    def __len__(self) -> int:
        n = self._trainer.num_training_batches
        if n is None:
            raise TypeError("the training loader has no length")
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def loader_settings(loader: Any) -> dict[str, Any]:
    """A `DataLoader`'s settings other than its dataset and how it samples, to rebuild it with another
    sampler (`unshuffled`, `recording_indices`, the distributed sampler, a resumed epoch)."""
    settings: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


def unshuffled(loader: Iterable[Any]) -> Iterable[Any]:
    """`loader` reading its dataset in order (for `overfit_batches`: the same first batches every
    epoch). A `DataLoader` with a shuffling sampler is rebuilt with a `SequentialSampler` and its other
    settings; anything else is returned as it is."""
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, RandomSampler):
        return loader
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=SequentialSampler(loader.dataset),  # type: ignore[arg-type]  # a map-style dataset (it had a RandomSampler)
        drop_last=loader.drop_last,
        **loader_settings(loader),
    )


class IndexRecorder:
    """A batch sampler that remembers the dataset indices of every batch it yields, in order.

    The loader asks its batch sampler ahead of the batches it hands out (worker prefetching), so the
    indices of batch `i` are `seen[i]`, not the last list seen."""

    def __init__(self, batch_sampler: Iterable[list[int]]) -> None:
        self.batch_sampler = batch_sampler
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen = []
        for indices in self.batch_sampler:
            self.seen.append([int(i) for i in indices])
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]  # a DataLoader's batch sampler has a length


def recording_indices(loader: Iterable[Any]) -> tuple[Iterable[Any], IndexRecorder | None]:
    """`loader` rebuilt so that the dataset indices of each batch can be read (`recorder.seen[i]`), as
    Lightning's prediction writers get them. Only an exact `DataLoader` over a map-style dataset that
    batches (anything else: the loader unchanged and None: no indices can be known)."""
    from torch.utils.data import DataLoader, IterableDataset

    if type(loader) is not DataLoader or loader.batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        return loader, None
    recorder = IndexRecorder(loader.batch_sampler)
    return DataLoader(loader.dataset, batch_sampler=recorder, **loader_settings(loader)), recorder


def as_loader_list(loader: Any) -> list[Any]:
    """Several validation/test/predict loaders come as a list or tuple of loaders; one loader as itself.
    A list whose items are batches (tensors, tuples, dicts) is one loader written as a list."""
    if isinstance(loader, (list, tuple)) and loader and all(_is_loader(x) for x in loader):
        return list(loader)
    return [loader]


def _is_loader(x: Any) -> bool:
    return hasattr(x, "__iter__") and not hasattr(x, "shape") and not isinstance(x, (list, tuple, dict, str))


def takes_dataloader_idx(step: Any) -> bool:
    """Whether a `validation_step`/`test_step`/`predict_step` accepts a third argument, `dataloader_idx`
    (Lightning's signature with several loaders). Read once (at setup, or per `test()`/`predict()` call),
    never per batch."""
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False
    if "dataloader_idx" in params or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return True
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3

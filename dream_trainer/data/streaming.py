"""`ShardedIterable`: a stream of shards split over data-parallel ranks and loader workers, with a
seeded per-epoch shard order and an exact resume.

A subclass says how many shards a pass has (`num_shards`) and how to read one (`read_shard`); the
base decides which shards this (rank, worker) reads (`shard_indices`), in which order, and where it is:
`state_dict()` / `load_state_dict()` are what torchdata's `StatefulDataLoader` calls in each worker, so
a loader checkpointed mid-pass resumes with nothing replayed and nothing skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import IterableDataset

from dream_trainer.data.sharding import DataParallelAware, _check_rank, _worker, shard_indices
from dream_trainer.errors import CheckpointError

__all__ = ["ShardedIterable"]

T_co = TypeVar("T_co", covariant=True)


class ShardedIterable(IterableDataset[T_co], DataParallelAware):
    """Base class for an `IterableDataset` whose shards are split over data-parallel ranks x loader workers.

    Subclasses implement `num_shards()` and `read_shard(index, start)`; they never look at ranks or
    workers. A shard is whatever the data comes in: a file, a URL, a window of a token file.

    Args:
        shuffle: read the shards of each pass in a seeded random order (`seed + epoch`, as
            `DistributedSampler` does); `set_epoch(epoch)` picks the pass.
        seed: the seed of that order; the same on every rank.
        infinite: after the last shard, go on with the next pass (epoch + 1, reshuffled) instead of
            ending: a stream for step-based training (`max_steps`), where ranks never run dry at
            different times.
        even: leave out the last `num_shards % size` shards of each pass so every rank gets as many
            shards as the others (left-out shards differ between passes when shuffled).

    The trainer calls `set_data_parallel(rank, size)` under data parallelism and `set_epoch(epoch)`
    before each epoch; without them the dataset reads everything as rank 0 of 1, pass 0.
    """

    samples_per_shard: int | None = None
    """Samples in every shard, where a subclass knows it to be one number (`TokenDataset`: 1, a window). With
    one sample a shard, a pass's order over all ranks is the same at any world size; with more (or unknown),
    the parts of the run's start are kept on other numbers of ranks (`read_as_parts`), and this number lets a
    position inside a part skip whole shards unread."""

    def __init__(self, *, shuffle: bool = False, seed: int = 0, infinite: bool = False, even: bool = False) -> None:
        self.shuffle = shuffle
        self.seed = seed
        self.infinite = infinite
        self.even = even
        self._rank = 0
        self._size = 1
        self._epoch = 0
        self._cursor: dict[str, int] | None = None
        """Where the running iteration is: the pass, the position in this reader's shards and the samples read
        of that shard (`epoch`, `shard`, `sample`), or read as parts the samples of the rank's part read and
        the parts (`epoch`, `position`, `parts`)."""
        self._pending: dict[str, Any] | None = None
        """A state loaded by `load_state_dict`, where the next `iter()` starts."""
        self._parts: int | None = None
        """The parts each pass is read as (`read_as_parts`); None: as many as ranks."""

    # --- what a subclass provides -------------------------------------------------------------------
    def num_shards(self) -> int:
        """How many shards one pass has."""
        raise NotImplementedError(f"{type(self).__name__} must implement num_shards()")

    def read_shard(self, index: int, start: int) -> Iterator[T_co]:
        """The samples of shard `index`, beginning with its sample number `start` (0 unless resuming)."""
        raise NotImplementedError(f"{type(self).__name__} must implement read_shard(index, start)")

    # --- what the trainer and the loader call -------------------------------------------------------
    def set_data_parallel(self, rank: int, size: int) -> None:
        _check_rank(rank, size)
        self._rank, self._size = rank, size

    def set_epoch(self, epoch: int) -> None:
        """Read pass `epoch` from its start at the next `iter()` (a state loaded afterwards wins)."""
        self._epoch = epoch

    @property
    def epoch(self) -> int:
        """The pass the next `iter()` starts (without a loaded state)."""
        return self._epoch

    def pass_order(self, epoch: int) -> list[int]:
        """All shard indices of pass `epoch`, in the order the ranks deal them out (seeded where shuffled)."""
        n = self.num_shards()
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def shards_of_pass(self, epoch: int, worker_info: Any = None) -> list[int]:
        """The shard indices this (rank, worker) reads in pass `epoch`, in order."""
        part = shard_indices(self.num_shards(), self._rank, self._size, worker_info, even=self.even)
        return self.pass_order(epoch)[part.start : part.stop : part.step]

    def read_as_parts(self, parts: int) -> None:
        """Read each pass as the `parts` parts of `parts` ranks, whatever the number of ranks (the trainer
        sets the data-parallel size of the run's start when it resumes a checkpoint: see
        `dream_trainer.data.parts`), so a global batch of a multiple of `parts` samples holds the samples it
        held there. Each rank reads with `num_workers` 0 or 1."""
        if parts < 1:
            raise ValueError(f"{type(self).__name__}.read_as_parts: parts must be >= 1, got {parts}")
        self._parts = parts

    @property
    def parts(self) -> int:
        """The parts a pass is read as: `read_as_parts`'s, or as many as data-parallel ranks."""
        return self._parts if self._parts is not None else self._size

    def global_order(self) -> tuple[Any, ...] | None:
        """What decides the order of a pass's samples over all ranks together, read with `num_workers` 0 or 1
        per rank (the loader's business, checked by the trainer): the ranks of a step read positions
        `[k, k + ranks x batch)` of it at any world size, as a `DistributedSampler`'s do.

        One sample a shard (`samples_per_shard`) and a pass that ends: `("stream", class, seed or None,
        shards)`, sample `i` of the pass's order going to rank `i % size` at every size. Otherwise the order
        is that of the parts (`parts`, appended): sample `i` of part `p` at position `i x parts + p`
        (`dream_trainer.data.parts`)."""
        order = ("stream", type(self).__qualname__, self.seed if self.shuffle else None, self.num_shards())
        if self.samples_per_shard == 1 and not self.infinite:
            return order
        return (*order, self.parts)

    def continue_part_at(self, position: int) -> None:
        """Start the next `iter()` at sample `position` of this rank's part of the current pass: where a
        resumed run continues from the global sample cursor (the samples of the pass all its ranks had read,
        `position x ranks`), on this number of ranks or another. A loader worker started now takes it with
        its copy of the dataset: `forget_position()` once the loader's iterator exists, so that the next pass
        (its workers copy the dataset again) starts at its beginning."""
        where = {"rank": self._rank, "size": self._size, "worker_id": 0, "num_workers": 1}
        if self.samples_per_shard == 1 and not self.infinite:  # the rank's first `position` shards read
            self._pending = {"epoch": self._epoch, "shard": position, "sample": 0, **where}
        else:  # the part's first `position` samples: counted by reading them (`rank_samples`)
            self._pending = {"epoch": self._epoch, "position": position, "parts": self.parts, **where}

    def forget_position(self) -> None:
        """Drop a position `continue_part_at` or `load_state_dict` set and no `iter()` here has taken (a loader
        worker took it with its copy): the next `iter()` starts its pass at the beginning."""
        self._pending = None

    def __iter__(self) -> Iterator[T_co]:
        # The start is taken now, not inside the generator: a loader may create an iterator it never
        # reads (StatefulDataLoader does when a saved pass had ended), and must not use up the state.
        state = self._start()
        if "position" in state or self.parts != self._size:  # read as parts (`dream_trainer.data.parts`)
            epoch, position = int(state["epoch"]), int(state.get("position", 0))
            self._cursor = {"epoch": epoch, "position": position, "parts": self.parts}
            return self._generate_parts(epoch, position)
        epoch, position, sample = int(state["epoch"]), int(state["shard"]), int(state["sample"])
        self._cursor = {"epoch": epoch, "shard": position, "sample": sample}
        return self._generate(epoch, position, sample)

    def _generate_parts(self, epoch: int, start: int) -> Iterator[T_co]:
        from dream_trainer.data.parts import rank_samples

        self._check_parts()
        parts = self.parts
        for position, item in rank_samples(self, self._rank, self._size, parts, epoch, start):
            self._cursor = {"epoch": epoch, "position": position, "parts": parts}
            yield item

    def _check_parts(self) -> None:
        num_workers = _worker(None)[1]
        if num_workers > 1:
            raise ValueError(
                f"{type(self).__name__} is read as {self.parts} parts on {self._size} data-parallel rank(s) (a run "
                f"resumed on another number of ranks), which needs one loader process per rank: set "
                f"num_workers=0 or 1 (it is {num_workers})"
            )
        if self.parts > self.num_shards():
            raise ValueError(
                f"{type(self).__name__}: {self.parts} parts of {self.num_shards()} shards leave some empty; give "
                "the data at least as many shards as the run's data-parallel ranks"
            )

    def _generate(self, epoch: int, position: int, sample: int) -> Iterator[T_co]:
        while True:
            shards = self.shards_of_pass(epoch)
            if not shards and not shard_indices(self.num_shards(), self._rank, self._size, (0, 1), even=self.even):
                raise ValueError(
                    f"{type(self).__name__}: data-parallel rank {self._rank} of {self._size} has no shard to read "
                    f"({self.num_shards()} shards); give the data at least as many shards as ranks"
                )
            while position < len(shards):
                for item in self.read_shard(shards[position], sample):
                    sample += 1
                    self._cursor = {"epoch": epoch, "shard": position, "sample": sample}
                    yield item
                position, sample = position + 1, 0
                self._cursor = {"epoch": epoch, "shard": position, "sample": 0}
            if not self.infinite:
                return
            epoch, position = epoch + 1, 0
            self._cursor = {"epoch": epoch, "shard": 0, "sample": 0}

    def _start(self) -> dict[str, Any]:
        state, self._pending = self._pending, None
        if state is None:
            return {"epoch": self._epoch, "shard": 0, "sample": 0}
        worker_id, num_workers = _worker(None)
        saved = (state["size"], state["num_workers"], state["rank"], state["worker_id"])
        if saved != (self._size, num_workers, self._rank, worker_id):
            raise CheckpointError(
                f"{type(self).__name__}: the saved data position belongs to data-parallel rank {state['rank']} of "
                f"{state['size']}, loader worker {state['worker_id']} of {state['num_workers']}, but it is loaded "
                f"by rank {self._rank} of {self._size}, worker {worker_id} of {num_workers}; resume with the same "
                "data-parallel size and num_workers"
            )
        if "parts" in state:
            self._parts = None if int(state["parts"]) == self._size else int(state["parts"])
        return state

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is: the pass, the shard and the sample within it (read as parts: the sample of
        the rank's part, and the parts), and who reads."""
        if self._pending is not None:
            return dict(self._pending)
        cursor = self._cursor if self._cursor is not None else {"epoch": self._epoch, "shard": 0, "sample": 0}
        worker_id, num_workers = _worker(None)
        return {**cursor, "rank": self._rank, "size": self._size, "worker_id": worker_id, "num_workers": num_workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next `iter()` where `state` was taken (checked then against the rank and worker)."""
        keys = {"position", "parts"} if "parts" in state else {"shard", "sample"}
        missing = {"epoch", "rank", "size", "worker_id", "num_workers", *keys} - set(state)
        if missing:
            raise CheckpointError(
                f"{type(self).__name__}.load_state_dict: the state lacks {sorted(missing)}; "
                "pass what state_dict() returned"
            )
        self._pending = dict(state)

"""A stream read as the parts of the run's start, on any number of ranks: what lets a run whose shards hold
several samples continue on another number of processes with the same samples in every global batch.

On `P` data-parallel ranks a `ShardedIterable` deals each pass's shards out round-robin: part `p` (rank `p`'s)
is shards `p, p + P, p + 2P, ...` of the pass's order, read one after the other, each sample in turn. A step's
global batch is then the next `batch` samples of every part, so which samples it holds depends on `P`. To keep
them on `S` ranks, the parts stay the `P` of the run's start (`ShardedIterable.read_as_parts`) and their
samples are interleaved into one sequence, sample `i` of part `p` at position `g = i x P + p`; rank `s` of `S`
reads positions `s, s + S, s + 2S, ...` of it (as a `DistributedSampler` deals out indices). A global batch of
`P x batch` samples (the size a resume keeps: `dream_trainer.utils.data_reshard`) covers positions
`[k, k + P x batch)`: the same samples as on `P` ranks, at any `S` dividing it.

Where `S` divides `P`, a rank reads `P / S` parts one sample of each in turn; where `P` divides `S`, a part is
read by `S / P` ranks, each taking every `(S / P)`-th sample of it; otherwise each rank reads the parts it has
samples in and drops the others' samples (read, not kept). A position inside a part is reached by reading
its samples from the start of the pass and dropping them (whole shards are skipped where the stream says how
many samples each holds: `samples_per_shard`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dream_trainer.data.sharding import shard_indices

if TYPE_CHECKING:
    from dream_trainer.data.streaming import ShardedIterable

__all__ = ["part_of_pass", "rank_samples"]

_END = object()


def part_of_pass(order: list[int], part: int, parts: int, even: bool) -> list[int]:
    """The shards of part `part` of `parts` in a pass whose shard order is `order`: those rank `part` of
    `parts` reads in one process (`shard_indices`; with `even`, the last `len(order) % parts` are left out)."""
    mine = shard_indices(len(order), part, parts, (0, 1), even=even)
    return order[mine.start : mine.stop : mine.step]


class _Part:
    """The samples of one part from sample `start` on (into the next passes where the stream is infinite)."""

    def __init__(self, stream: ShardedIterable[Any], part: int, parts: int, epoch: int, start: int) -> None:
        self._samples = self._read(stream, part, parts, epoch, start)
        self._next = start

    @staticmethod
    def _read(stream: ShardedIterable[Any], part: int, parts: int, epoch: int, skip: int) -> Iterator[Any]:
        while True:
            shards = part_of_pass(stream.pass_order(epoch), part, parts, stream.even)
            first = 0
            if stream.samples_per_shard:  # whole shards skipped without reading them
                first = min(skip // stream.samples_per_shard, len(shards))
                skip -= first * stream.samples_per_shard
            for index in shards[first:]:
                for item in stream.read_shard(index, 0):
                    if skip:
                        skip -= 1
                        continue
                    yield item
            if not stream.infinite:
                return
            epoch += 1

    def take(self, index: int) -> Any:
        """Sample `index` of the part (`_END` after its last); the samples before it that were not taken are
        dropped. `index` never goes back."""
        item = _END
        while self._next <= index:
            item = next(self._samples, _END)
            if item is _END:
                return _END
            self._next += 1
        return item


def rank_samples(
    stream: ShardedIterable[Any], rank: int, size: int, parts: int, epoch: int, position: int
) -> Iterator[tuple[int, Any]]:
    """Rank `rank` of `size`'s samples of the stream read as `parts` parts, from its sample `position` of pass
    `epoch` on, each with the position after it: positions `rank + j x size` (j >= `position`) of the
    parts' interleave. It ends at the first position whose part has ended (parts of equal length end together)."""
    readers: dict[int, _Part] = {}
    j = position
    while True:
        g = rank + j * size
        part, index = g % parts, g // parts
        reader = readers.get(part)
        if reader is None:
            reader = readers[part] = _Part(stream, part, parts, epoch, index)
        item = reader.take(index)
        if item is _END:
            return
        j += 1
        yield j, item

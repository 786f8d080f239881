"""`ShardList`: a webdataset-style list of shard files, each (rank, loader worker) reading its own.

A shard is one file of samples: a `.tar` whose members are grouped into samples by their name up to
the first dot (webdataset's layout: `000.jpg`, `000.cls`, `001.jpg`, ... gives
`{"__key__": "000", "jpg": b"...", "cls": b"..."}`), a `.jsonl` file (one JSON object per line), or
anything a `read` function turns into an iterable of samples.
"""

from __future__ import annotations

import itertools
import json
import os
import posixpath
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from dream_trainer.data.streaming import ShardedIterable

__all__ = ["ShardList", "read_jsonl", "read_tar"]


def read_tar(path: str) -> Iterator[dict[str, Any]]:
    """The samples of a webdataset-style tar: consecutive members with the same key form one sample,
    a dict of `{extension: bytes}` plus `"__key__"`."""
    sample: dict[str, Any] = {}
    with tarfile.open(path, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            dirname, basename = posixpath.split(member.name)
            stem, dot, ext = basename.partition(".")
            key = posixpath.join(dirname, stem)
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            sample["__key__"] = key
            handle = tar.extractfile(member)
            sample[ext if dot else ""] = handle.read() if handle is not None else b""
    if sample:
        yield sample


def read_jsonl(path: str) -> Iterator[Any]:
    """One JSON value per non-empty line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


_READERS: dict[str, Callable[[str], Iterable[Any]]] = {".tar": read_tar, ".jsonl": read_jsonl}


class ShardList(ShardedIterable[Any]):
    """Samples from a list of shard files; each data-parallel rank x loader worker reads its own files.

    Shard `i` of a pass goes to rank `i % size` and, within it, to worker `(i // size) % num_workers`
    (see `shard_indices`), so no file is read twice and none is missed. With `shuffle` the files come in
    a seeded random order that changes with `set_epoch`. Resume is exact (the file and the sample
    within it); the samples of a half-read file before the saved one are read again and dropped. A run
    resumed on another number of ranks reads the files as the parts of its start (`read_as_parts`,
    `dream_trainer.data.parts`), so its global batches stay those of the uninterrupted run.

    Give at least as many files as data-parallel ranks (an error says so otherwise), and as many as
    ranks x `num_workers` to keep every worker busy. Files hold different numbers of samples, so ranks
    may run out at different steps: train by steps (`max_steps`) with `infinite=True`, so that no rank
    waits for another at the end of a pass.

    Args:
        paths: the shard files, the same list on every rank.
        read: a function from a path to an iterable of samples; default by extension: `.tar`
            (webdataset layout, `read_tar`) or `.jsonl` (`read_jsonl`).
        shuffle, seed, infinite, even: see `ShardedIterable`.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        read: Callable[[str], Iterable[Any]] | None = None,
        *,
        shuffle: bool = False,
        seed: int = 0,
        infinite: bool = False,
        even: bool = False,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, infinite=infinite, even=even)
        if isinstance(paths, (str, os.PathLike)):
            raise TypeError(f"ShardList takes a list of paths, got the single path {os.fspath(paths)!r}")
        self.paths = [os.fspath(p) for p in paths]
        if read is None:
            unknown = sorted({os.path.splitext(p)[1] for p in self.paths} - set(_READERS))
            if unknown:
                raise ValueError(
                    f"ShardList: no reader for {', '.join(repr(u) for u in unknown)} files; pass read=a function from "
                    f"a path to its samples (built in: {', '.join(_READERS)})"
                )
        self.read = read

    def num_shards(self) -> int:
        return len(self.paths)

    def read_shard(self, index: int, start: int) -> Iterator[Any]:
        path = self.paths[index]
        read = self.read if self.read is not None else _READERS[os.path.splitext(path)[1]]
        return itertools.islice(iter(read(path)), start, None)

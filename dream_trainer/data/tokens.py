"""Token files for language models: fixed-length windows of memory-mapped token ids.

The file layout is nanoGPT's `.bin`: the token ids one after the other, raw little-endian `uint16`
(vocabularies up to 65,536, like GPT-2's) or `uint32`, no header. `np.array(ids, dtype=np.uint16).tofile(path)`
writes one. Window `i` of a file is `x = tokens[s : s + T]`, `y = tokens[s + 1 : s + T + 1]` with
`s = i * T`, so the windows of a pass do not overlap and every token is a target once per pass.

- `TokenWindows`: map-style (`dataset[i]`), for any sampler (`InfiniteSampler`, `DistributedSampler`).
- `TokenDataset`: iterable, split over data-parallel ranks x loader workers, read in order or in a seeded
  random order per epoch, resumable exactly inside torchdata's `StatefulDataLoader`.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dream_trainer.data.streaming import ShardedIterable

__all__ = ["TOKEN_DTYPES", "TokenDataset", "TokenWindows"]

TOKEN_DTYPES = ("uint16", "uint32")
"""The token id types a token file may hold (little-endian)."""

PathLike = str | os.PathLike[str]


def _paths(paths: PathLike | Sequence[PathLike]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    out = [os.fspath(p) for p in paths]
    if not out:
        raise ValueError("token files: give at least one path")
    return out


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window `i` of one or more token files, as `(x, y)` int64 tensors of length `seq_len`.

    Windows never cross from one file into the next; the tail of a file shorter than a window (plus
    one target token) is not read. The files are memory-mapped on first use in each process (a loader
    worker maps them itself; nothing is copied when the dataset is sent to it).

    Args:
        paths: a token file, or a list of them (read one after the other).
        seq_len: tokens per window (the model's context length).
        dtype: `"uint16"` or `"uint32"`, what the files hold.
    """

    def __init__(self, paths: PathLike | Sequence[PathLike], seq_len: int, dtype: str = "uint16") -> None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token files: dtype={dtype!r} is not supported; use one of {', '.join(TOKEN_DTYPES)}")
        if seq_len < 1:
            raise ValueError(f"token files: seq_len must be >= 1, got {seq_len}")
        self.paths = _paths(paths)
        self.seq_len = seq_len
        self.dtype = dtype
        itemsize = np.dtype(dtype).itemsize
        counts = []
        for path in self.paths:
            size = os.path.getsize(path)
            if size % itemsize:
                raise ValueError(
                    f"token file {path} has {size} bytes, not a multiple of {itemsize} ({dtype}); "
                    "is dtype right (uint16 vs uint32)?"
                )
            counts.append(max(0, (size // itemsize - 1) // seq_len))
        self._first = [0]
        """Index of the first window of each file, then the total."""
        for n in counts:
            self._first.append(self._first[-1] + n)
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self._first[-1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range: the token files have {len(self)} windows")
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r") for p in self.paths]
        f = bisect.bisect_right(self._first, index) - 1
        start = (index - self._first[f]) * self.seq_len
        tokens = torch.from_numpy(self._maps[f][start : start + self.seq_len + 1].astype(np.int64))
        return tokens[:-1], tokens[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None  # each process maps the files itself
        return state


class TokenDataset(ShardedIterable[tuple[torch.Tensor, torch.Tensor]]):
    """The windows of token files as a stream split over data-parallel ranks x loader workers.

    Each pass reads every window once across all ranks and workers (with `even`, the default, the last
    `len % size` windows of the pass's order are left out so every rank reads as many). With `shuffle`,
    the windows come in a seeded random order that changes with `set_epoch` (the trainer calls it);
    otherwise in file order. `state_dict()` / `load_state_dict()` make it resume exactly inside
    torchdata's `StatefulDataLoader`, with any `num_workers`.

    ```python
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TokenDataset("train.bin", seq_len=256, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=32, num_workers=2)   # batches of (x, y): (32, 256) each
    ```

    Args:
        paths: a token file, or a list of them.
        seq_len: tokens per window.
        dtype: `"uint16"` or `"uint32"`.
        shuffle, seed, infinite, even: see `ShardedIterable`.
    """

    samples_per_shard = 1  # a shard is a window: a pass's order over all ranks is the same at any world size

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        seq_len: int,
        dtype: str = "uint16",
        *,
        shuffle: bool = False,
        seed: int = 0,
        infinite: bool = False,
        even: bool = True,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, infinite=infinite, even=even)
        self.windows = TokenWindows(paths, seq_len, dtype)

    def num_shards(self) -> int:
        return len(self.windows)

    def read_shard(self, index: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if start == 0:
            yield self.windows[index]

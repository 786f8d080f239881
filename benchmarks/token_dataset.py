"""Throughput of `TokenDataset` (iterable, sharded, resumable) against a plain `DataLoader` over the
map-style `TokenWindows` of the same token file.

    python benchmarks/token_dataset.py                      # 64 Mi tokens of uint16, seq_len 256, batch 32
    python benchmarks/token_dataset.py --workers 4 --seq-len 1024 --batches 400

Each row reads `--batches` batches of shuffled windows, after a warm-up of a few batches (worker start
and page cache); samples/s is windows per second. The ratios are against the plain DataLoader without
workers: what a training loop gains by moving the reads to loader workers, and what the stateful,
sharded dataset costs over an index-based read.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from dream_trainer.data import TokenDataset, TokenWindows

WARMUP = 5


def samples_per_s(loader: Iterable[Any], batches: int) -> float:
    it = iter(loader)
    for _ in range(WARMUP):
        next(it)
    n = 0
    start = time.perf_counter()
    for _ in range(batches):
        x, _y = next(it)
        n += x.shape[0]
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64 * 2**20, help="tokens in the file (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="loader workers (default: %(default)s)")
    p.add_argument("--batches", type=int, default=200, help="batches timed per row (default: %(default)s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        rng = np.random.default_rng(0)
        rng.integers(0, 50_257, size=args.tokens, dtype=np.uint16).tofile(path)
        windows = TokenWindows(path, args.seq_len)
        bs, w = args.batch_size, args.workers

        def stream() -> TokenDataset:
            return TokenDataset(path, args.seq_len, shuffle=True, seed=0, infinite=True)

        rows = {
            "DataLoader(TokenWindows, shuffle), 0 workers": DataLoader(windows, batch_size=bs, shuffle=True),
            f"DataLoader(TokenWindows, shuffle), {w} workers": DataLoader(
                windows, batch_size=bs, shuffle=True, num_workers=w
            ),
            "StatefulDataLoader(TokenDataset, shuffle), 0 workers": StatefulDataLoader(stream(), batch_size=bs),
            f"StatefulDataLoader(TokenDataset, shuffle), {w} workers": StatefulDataLoader(
                stream(), batch_size=bs, num_workers=w
            ),
        }
        results = {name: samples_per_s(loader, args.batches) for name, loader in rows.items()}
    base = next(iter(results.values()))
    print(f"{args.tokens:,} uint16 tokens, {len(windows):,} windows of {args.seq_len}, batch {bs}")
    for name, rate in results.items():
        print(f"  {name:<52} {rate:>10,.0f} samples/s  x{rate / base:.2f}")
    print("command: python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    return results


if __name__ == "__main__":
    main()

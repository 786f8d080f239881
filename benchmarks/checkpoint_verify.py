"""What verifying a checkpoint adds to reading it (`dream_trainer.utils.checkpoint_verify`).

The state of `benchmarks/checkpoint.py`'s MLP (`--depth` Linear(`--width`, `--width`) layers, default 8 x 2048:
33.6M parameters, with AdamW state after one step: a 403 MB file) is written once with the trainer's
`atomic_save`, then read back `--reps` times after one warm-up round, the cases interleaved (the order rotates
each round) and reported as medians, the file in the page cache:

- read: `read_checkpoint(path)`, what the trainer does: the bytes against their CRC-32 records, `torch.load`,
  the sections, the weights finite;
- load only: `torch.load(path, map_location="cpu", weights_only=True)`, the same read without verification;
- and its parts: the CRC-32 pass alone (`verify_bytes`), the finiteness check alone (`verify_finite`).

    python benchmarks/checkpoint_verify.py                 # 8 x 2048 MLP, 5 rounds
    python benchmarks/checkpoint_verify.py --quick         # tiny model, 1 round (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dream_trainer.utils.checkpoint_io import atomic_save, read_checkpoint
from dream_trainer.utils.checkpoint_verify import verify_bytes, verify_finite


def _state(width: int, depth: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    sections = ["counters", "dream_trainer", "models", "optimizers"]
    return {
        "dream_trainer": {"format_version": 1, "sections": sections},
        "counters": {"global_step": 1},
        "models": {"model": model.state_dict()},
        "optimizers": {"optimizer": optimizer.state_dict()},
    }


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 x Linear(128, 128), 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.reps = 128, 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.ckpt"
        atomic_save(_state(args.width, args.depth), path)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        cases: dict[str, Callable[[], Any]] = {
            "read": lambda: read_checkpoint(path),
            "load_only": lambda: torch.load(path, map_location="cpu", weights_only=True),
            "crc": lambda: verify_bytes(path),
            "finite": lambda: verify_finite(path, loaded),
        }
        names = list(cases)
        times: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(args.reps + 1):
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                t = _timed(cases[name])
                if rnd > 0:  # round 0 warms the page cache and the allocator
                    times[name].append(t)
        size = path.stat().st_size
    med = {n: statistics.median(v) for n, v in times.items()}
    result = {
        **{f"{n}_s": v for n, v in med.items()},
        "file_mb": size / 1e6,
        "verify_ratio": med["read"] / med["load_only"],
    }
    print(f"checkpoint of {size / 1e6:.0f} MB, medians of {args.reps} interleaved rounds (torch {torch.__version__})")
    print("| case | time | vs torch.load |")
    print("|---|---:|---:|")
    for name, label in (
        ("read", "read_checkpoint (CRC-32, torch.load, sections, finite)"),
        ("load_only", "torch.load(weights_only=True) alone"),
        ("crc", "of which: the CRC-32 pass (verify_bytes)"),
        ("finite", "of which: the finiteness check (verify_finite)"),
    ):
        print(f"| {label} | {med[name]:.3f} s | {med[name] / med['load_only']:.2f}x |")
    return result


if __name__ == "__main__":
    main()

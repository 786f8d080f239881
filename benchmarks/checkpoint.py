"""Checkpoint cost of dream_trainer against plain `torch.save` / `torch.load`.

An MLP of `--depth` Linear(`--width`, `--width`) layers (default 8 x 2048: 33.6M parameters) with
AdamW state (one step taken), so the file holds about 400 MB. One process, the trainer set up by
`state_dict()` (no `fit()`); every measurement is repeated `--reps` times after one warm-up round,
interleaved (the order rotates each round, so drift on the machine hits every case alike), and
reported as a median. Before each case (untimed) files are deleted and `os.sync()` flushes earlier
writes, so no case pays for another's write-back; files are read back from the page cache.

- save: `trainer.save_checkpoint(path)` (builds `state_dict()`, writes a temporary file while the
  kernel writes it back, fsyncs it, renames it) against `torch.save(state, path)` of the very same
  state (no fsync) and, for context, `torch.save` followed by an fsync, and `save_checkpoint` with
  `checkpoint_crc32=False`. Target: at most 1.2x `torch.save`.
- disk floor: the same number of bytes, already in memory, written durably with no serialisation at
  all (`DurableFile`: write-back started every 32 MB, fsync at the end). No durable save can be
  faster than this; `torch.save` is, because it leaves the bytes in the page cache. When the disk
  takes longer than `torch.save` to absorb the file, the floor itself is above 1.0x `torch.save` and
  the target above is out of reach for any save that fsyncs (as crash safety requires).
- load: `trainer.load_checkpoint(path)` (`torch.load(weights_only=True)` plus restoring models,
  optimizers, schedulers, counters, RNG, callbacks) against `torch.load(path, weights_only=True)` +
  `model.load_state_dict` + `optimizer.load_state_dict`. Target: at most 1.2x.
- async: with `config.async_checkpointing=True`, how long `save_checkpoint` blocks its caller (it
  copies everything but the optimizers' per-parameter state to the CPU there: a clone, since the
  model already is on the CPU; the writer thread copies the optimizer state, which only the next
  `optimizer.step()` could change, and that step waits for it), against a synchronous save; then
  `wait_for_checkpoint()`. Target: blocking at most 10% of a synchronous save. The reference row
  "copy of the state" is the whole state copied at once, as the save did before.

    python benchmarks/checkpoint.py                       # 8 x 2048 MLP, 5 rounds
    python benchmarks/checkpoint.py --width 4096 --depth 3 --reps 3
    python benchmarks/checkpoint.py --quick               # tiny model, 1 round (smoke test)
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.utils.checkpoint_io import detached_cpu_copy
from dream_trainer.utils.durable_file import DurableFile


class BenchTrainer(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, width: int, depth: int) -> None:
        super().__init__(config)
        self.width, self.depth = width, depth

    def configure_models(self) -> None:
        layers: list[nn.Module] = []
        for _ in range(self.depth):
            layers += [nn.Linear(self.width, self.width), nn.ReLU()]
        self.model = nn.Sequential(*layers)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=10)

    def configure_dataloaders(self) -> tuple[list[torch.Tensor], None]:
        return [torch.zeros(1, self.width)], None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).square().mean()


def make_trainer(
    width: int, depth: int, directory: Path, async_checkpointing: bool, crc32: bool = True
) -> BenchTrainer:
    config = DreamTrainerConfig(
        seed=0,
        device="cpu",
        root_dir=str(directory),
        print_epoch_summary=False,
        num_sanity_val_steps=0,
        async_checkpointing=async_checkpointing,
        checkpoint_crc32=crc32,
    )
    trainer = BenchTrainer(config, width, depth)
    trainer.state_dict()  # sets the trainer up (configure_*), as fit() would
    # One optimizer step so AdamW holds its state (exp_avg, exp_avg_sq), as in a real checkpoint.
    trainer.model(torch.randn(4, width)).square().mean().backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return trainer


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fresh(path: Path) -> Path:
    path.unlink(missing_ok=True)
    return path


def _sync_disk() -> None:
    if hasattr(os, "sync"):
        os.sync()


def _save_fsync(state: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _write_durably(data: bytearray, path: Path) -> None:
    out = DurableFile(path)
    view = memoryview(data)
    for start in range(0, len(data), 1 << 20):  # in the record-sized pieces torch.save hands over
        out.write(view[start : start + (1 << 20)])
    out.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=2048, help="features of each Linear layer")
    p.add_argument("--depth", type=int, default=8, help="number of Linear(width, width) layers")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument("--dir", help="where the files go (default: a temporary directory); they are deleted after")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 x Linear(128, 128), 1 round")
    args = p.parse_args(argv)
    command = shlex.join(["python", "benchmarks/checkpoint.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.width, args.depth, args.reps = 128, 2, 1

    own_dir = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="dream-ckpt-bench-")) if own_dir else Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / f"bench-{name}.ckpt" for name in ("dream", "nocrc", "torch", "fsync", "floor", "async")}
    try:
        sync = make_trainer(args.width, args.depth, directory, async_checkpointing=False)
        asynchronous = make_trainer(args.width, args.depth, directory, async_checkpointing=True)
        no_crc = make_trainer(args.width, args.depth, directory, async_checkpointing=False, crc32=False)
        model, optimizer = sync.model, sync.optimizer
        state = sync.state_dict()  # the same dict save_checkpoint writes
        params = sum(t.numel() for t in model.parameters())
        torch.save(state, paths["torch"])  # only to learn the file's size, for the disk floor
        # Random bytes: a disk or a virtual disk that compresses or de-duplicates must not be favoured.
        raw = bytearray(os.urandom(1 << 20)) * max(1, paths["torch"].stat().st_size >> 20)

        async_total: list[float] = []

        def async_save() -> float:
            path = _fresh(paths["async"])
            start = time.perf_counter()
            asynchronous.save_checkpoint(path)
            blocked = time.perf_counter() - start
            asynchronous.wait_for_checkpoint()
            async_total.append(time.perf_counter() - start)
            return blocked

        def torch_load() -> None:
            loaded = torch.load(paths["torch"], map_location="cpu", weights_only=True)
            model.load_state_dict(loaded["models"]["model"])
            optimizer.load_state_dict(loaded["optimizers"]["optimizer"])

        cases: dict[str, Callable[[], Any]] = {
            "save": lambda: _timed(lambda: sync.save_checkpoint(_fresh(paths["dream"]))),
            "save_nocrc": lambda: _timed(lambda: no_crc.save_checkpoint(_fresh(paths["nocrc"]))),
            "torch_save": lambda: _timed(lambda: torch.save(state, _fresh(paths["torch"]))),
            "torch_save_fsync": lambda: _timed(lambda: _save_fsync(state, _fresh(paths["fsync"]))),
            "disk_floor": lambda: _timed(lambda: _write_durably(raw, _fresh(paths["floor"]))),
            "async": async_save,
            "cpu_copy": lambda: _timed(lambda: detached_cpu_copy(state)),
            "load": lambda: _timed(lambda: sync.load_checkpoint(paths["dream"])),
            "torch_load": lambda: _timed(torch_load),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for rnd in range(args.reps + 1):  # round 0 is the warm-up
            # Loads read the files the saves of this round wrote: saves first, each group rotated.
            saves, loads = names[:7], names[7:]
            order = saves[rnd % 7 :] + saves[: rnd % 7] + loads[rnd % 2 :] + loads[: rnd % 2]
            for name in order:
                # Dirty pages of an earlier write (torch.save does not fsync) would otherwise be
                # written back while the next case runs and be charged to it.
                _sync_disk()
                result = cases[name]()
                if rnd:
                    times[name].append(result)
        file_bytes = paths["dream"].stat().st_size
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)

    times["async_total"] = async_total[1:]  # without the warm-up round
    med = {name: statistics.median(v) for name, v in times.items()}

    def ratio(a: str, b: str) -> float:
        """Median of the per-round ratios (robust to drift between rounds)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    result: dict[str, Any] = {
        "command": command,
        "params": params,
        "file_bytes": file_bytes,
        "reps": args.reps,
        **{f"{name}_s": v for name, v in med.items()},
        **{f"{name}_min_s": min(v) for name, v in times.items()},
        "save_ratio": ratio("save", "torch_save"),
        "save_ratio_vs_fsync": ratio("save", "torch_save_fsync"),
        "save_nocrc_ratio": ratio("save_nocrc", "torch_save"),
        "disk_floor_ratio": ratio("disk_floor", "torch_save"),
        "save_ratio_vs_floor": ratio("save", "disk_floor"),
        "load_ratio": ratio("load", "torch_load"),
        "async_block_ratio": ratio("async", "save"),
        "cpu_copy_ratio": ratio("cpu_copy", "save"),
        "async_total_ratio": ratio("async_total", "save"),
    }
    _print_table(result, args)
    return result


def _print_table(r: dict[str, Any], args: argparse.Namespace) -> None:
    mb = r["file_bytes"] / 1e6
    print(f"`{r['command']}`\n")
    print(
        f"MLP {args.depth} x Linear({args.width}, {args.width}), {r['params'] / 1e6:.2f}M parameters + AdamW state; "
        f"checkpoint file {mb:.0f} MB; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{r['reps']} interleaved rounds after a warm-up; ratio = median of the per-round ratios; "
        "files read back from the page cache.\n"
    )
    rows = [
        ("trainer.save_checkpoint (state_dict + tmp file + fsync + rename)", "save",
         f"{r['save_ratio']:.2f}x torch.save", "<= 1.2x"),
        ("trainer.save_checkpoint with checkpoint_crc32=False (no zip checksums)", "save_nocrc",
         f"{r['save_nocrc_ratio']:.2f}x torch.save", ""),
        ("torch.save(same state)", "torch_save", "1.00x", ""),
        ("torch.save(same state) + fsync", "torch_save_fsync",
         f"save_checkpoint = {r['save_ratio_vs_fsync']:.2f}x this", ""),
        ("disk floor: the same bytes written durably, no serialisation", "disk_floor",
         f"{r['disk_floor_ratio']:.2f}x torch.save; save_checkpoint = {r['save_ratio_vs_floor']:.2f}x this", ""),
        ("trainer.load_checkpoint", "load", f"{r['load_ratio']:.2f}x torch.load + load_state_dict", "<= 1.2x"),
        ("torch.load(weights_only) + model/optimizer.load_state_dict", "torch_load", "1.00x", ""),
        ("async save_checkpoint: time the caller is blocked", "async",
         f"{r['async_block_ratio']:.1%} of a sync save", "<= 10%"),
        ("&nbsp;&nbsp;for reference: copy of the state to CPU (detached_cpu_copy)", "cpu_copy",
         f"{r['cpu_copy_ratio']:.1%} of a sync save", ""),
        ("async save_checkpoint + wait_for_checkpoint (total)", "async_total",
         f"{r['async_total_ratio']:.2f}x sync save", ""),
    ]  # fmt: skip
    print("| operation | median s | min s | ratio | target |")
    print("|---|---:|---:|---|---|")
    for label, key, ratio, target in rows:
        print(f"| {label} | {r[key + '_s']:.3f} | {r[key + '_min_s']:.3f} | {ratio} | {target} |")


if __name__ == "__main__":
    main()

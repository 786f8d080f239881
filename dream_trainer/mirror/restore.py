"""`pull`: what a fresh machine needs from the store before `fit()` chooses its run.

Called on global rank zero before the run is chosen. Always: each run's `run.json` and `config.yaml` that the
local `root_dir` lacks, so a new run never takes a name (`version_N`) another run already has in the store. For
`"last"`: the newest committed checkpoint (ordered as "last" orders local ones: the run that wrote a checkpoint
most recently, then the step in the name, then the time), each part checked against its commit marker (size,
CRC-32) before it takes its name, its modification time put back; then that run's other files (logs, run.json)
the local directory lacks, so the run continues its own history. A checkpoint whose parts do not match its
marker is skipped, with a line, for the next newest. Files already on disk are never replaced: a local copy is
as new as the store's or newer.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

from dream_trainer.mirror.commit import MARKER, Commit
from dream_trainer.mirror.store import Store, StoreError
from dream_trainer.utils.checkpoint_io import EXCEPTION_TAG
from dream_trainer.utils.run_dirs import CHECKPOINTS, CONFIG_FILE, RUN_FILE

_STEP = re.compile(r"step=(\d+)")


def pull(store: Store, root: Path, family: re.Pattern[str] | None, with_checkpoint: bool) -> str | None:
    """Bring what `fit()` needs from the store into `root` (see the module docstring). Returns the key of the
    checkpoint downloaded (None: none was needed or none is committed)."""
    listing = store.listing()
    runs = sorted({key.split("/", 1)[0] for key in listing if "/" in key})
    for run in runs:
        for name in (RUN_FILE, CONFIG_FILE):
            if f"{run}/{name}" in listing:
                _download_missing(store, root, f"{run}/{name}")
    if not with_checkpoint:
        return None
    commits = _commits(store, listing, family)
    for commit in commits:
        if all((root / p.key).exists() for p in commit.parts):
            return None  # the newest committed checkpoint is here already
        try:
            _download_checkpoint(store, root, commit)
        except (StoreError, ValueError) as exc:
            _say(f"mirror: skipping {commit.checkpoint} in the store: {exc}; trying the next newest")
            continue
        for key in sorted(listing):
            if key.startswith(f"{commit.run}/") and not key.startswith(f"{commit.run}/{CHECKPOINTS}/"):
                _download_missing(store, root, key)
        return commit.checkpoint
    return None


def _commits(store: Store, listing: dict[str, int], family: re.Pattern[str] | None) -> list[Commit]:
    """The committed checkpoints whose parts are all listed with their sizes, newest first (as "last" orders)."""
    commits: list[Commit] = []
    for key in listing:
        if not key.endswith(MARKER) or key.count("/") < 2:
            continue
        if family is not None and not family.match(key.split("/", 1)[0]):
            continue
        try:
            commit = Commit.decode(key, store.get_bytes(key))
        except (StoreError, ValueError, KeyError, TypeError) as exc:
            _say(f"mirror: ignoring {key}: {exc}")
            continue
        if all(listing.get(p.key) == p.size for p in commit.parts):
            commits.append(commit)
    newest_of_run: dict[str, float] = {}
    for c in commits:
        newest_of_run[c.run] = max(newest_of_run.get(c.run, -1.0), c.mtime)

    def order(c: Commit) -> tuple[float, str, bool, int, float]:
        name = c.checkpoint.rsplit("/", 1)[-1]
        step = _STEP.search(name)
        return newest_of_run[c.run], c.run, EXCEPTION_TAG not in name, int(step.group(1)) if step else -1, c.mtime

    return sorted(commits, key=order, reverse=True)


def _download_checkpoint(store: Store, root: Path, commit: Commit) -> None:
    """Every part to a temporary name, checked against the marker, then renamed into place (the directory of a
    sharded checkpoint last), with the checkpoint's modification time."""
    staged: list[tuple[Path, Path]] = []
    try:
        for part in commit.parts:
            final = root / part.key
            tmp = final.with_name(f".{final.name}.pull-{os.getpid()}")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            size, crc = store.get_stream(part.key, functools.partial(_write, tmp))
            staged.append((tmp, final))
            if (size, crc) != (part.size, part.crc32):
                raise ValueError(
                    f"{part.key} has {size} bytes, CRC-32 {crc:08x}; its commit marker says {part.size}, "
                    f"{part.crc32:08x}"
                )
        for tmp, final in staged:
            os.replace(tmp, final)
        staged = []
        target = root / commit.checkpoint
        os.utime(target, (commit.mtime, commit.mtime))
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def _write(path: Path, chunks: Iterator[bytes]) -> tuple[int, int]:
    size = crc = 0
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
        f.flush()
        os.fsync(f.fileno())
    return size, crc


def _download_missing(store: Store, root: Path, key: str) -> None:
    """`key` into `root` when it is in the store and not on disk (atomically: a temporary name, then renamed)."""
    final = root / key
    if final.exists():
        return
    data = store.get_bytes(key)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.pull-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, final)


def _say(line: str) -> None:
    print(f"dream_trainer: {line}", file=sys.stderr, flush=True)

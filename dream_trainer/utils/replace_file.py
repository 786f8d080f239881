"""Small files replaced whole (a CSV rewritten, `run.json`, `trackers.json`), and what a failed write says.

`replace_text` writes a hidden temporary file beside the target and renames it over the target, so a
reader sees the old contents or the new ones; a write that fails (a full disk) removes its temporary file
instead of leaving it behind. `replace_text(..., in_place_when_full=True)` is for a record that must say
how a run ended even on a full disk: when the temporary file cannot be written for lack of space, the
target is overwritten in place, which needs no new block while the new text fits the target's allocated
blocks (a small record: one block). `no_space_hint` words the free space for an error's first line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def is_no_space(exc: BaseException) -> bool:
    """True for an `OSError` that says the disk (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


def no_space_hint(path: Path) -> str:
    """ "no space left on the device (1.2 MiB free there)", measured at `path`'s nearest existing folder."""
    try:
        free = f"{shutil.disk_usage(_existing_parent(path)).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    return f"no space left on the device ({free})"


def _existing_parent(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path(".")


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Around writes to an open file: an `OSError` that names no file (a write, a flush) names `path`, so
    an error built from it (`LoggerWriteError`) can say which file."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def replace_text(path: Path, text: str, tmp: Path | None = None, in_place_when_full: bool = False) -> None:
    """Replace `path`'s contents with `text` atomically (through `tmp`, default `.<name>.tmp-<pid>`); the
    temporary file never outlives a failed write."""
    tmp = tmp if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not (in_place_when_full and is_no_space(exc) and path.is_file()):
            raise OSError(exc.errno, exc.strerror, str(path)) from exc  # named: the target, not the temporary
        with naming(path):
            _overwrite(path, text.encode())


def _overwrite(path: Path, data: bytes) -> None:
    # Written over the blocks the file has, then cut to length: no allocation while `data` fits them.
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()

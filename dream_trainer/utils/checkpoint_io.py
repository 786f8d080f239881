"""Checkpoint files: atomic writes, safe reads, the `last.ckpt` pointer and background writes.

Every write goes to a hidden temporary file in the target directory, is fsynced, then renamed over
the target (and the directory fsynced), so a crash at any moment leaves either the old file or the
new one, never a torn one. Reads use `torch.load(weights_only=True)`: a checkpoint can hold tensors,
numbers, strings and containers, never objects whose loading runs code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import threading
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

import torch

from dream_trainer.errors import CheckpointError
from dream_trainer.utils import checkpoint_verify as verified
from dream_trainer.utils.durable_file import DurableFile
from dream_trainer.utils.replace_file import is_no_space, no_space_hint
from dream_trainer.utils.warn import warn_user

LAST_NAME = "last.ckpt"
SUFFIX = ".ckpt"
TRAINER_STATE = "trainer_state.pt"  # inside a sharded checkpoint directory: everything but the shards
NONFINITE_TAG = "-nonfinite"  # in the name of a checkpoint whose weights are NaN/inf: never chosen by "last"
SIGNAL_PREFIX = "signal-"  # the checkpoint written on SIGTERM/SIGINT: signal-epoch=E-step=S.ckpt


class CheckpointWriteError(OSError, CheckpointError):
    """A checkpoint could not be written (disk full, permission denied, ...). An `OSError` with the
    original `errno`, and a `CheckpointError`; the message names the file and what to do. The partial
    file is gone and every earlier checkpoint is untouched."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_failure(path: Path, exc: OSError) -> CheckpointWriteError:
    """The error to raise when writing `path` failed with `exc`."""
    code = exc.errno
    reason = exc.strerror or str(exc) or type(exc).__name__
    if is_no_space(exc):
        hint = (
            f"{no_space_hint(path)}. Free some space, or keep fewer checkpoints "
            "(ModelCheckpoint(save_top_k=...)), then resume with fit(ckpt_path='last')"
        )
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = f"{reason}: make {str(path.parent)!r} writable, or choose another config.root_dir"
    else:
        hint = reason
    message = (
        f"cannot write checkpoint {str(path)!r}: {hint}. Nothing partial is left under that name, and "
        f"earlier checkpoints are untouched ({type(exc).__name__}: {exc})"
    )
    return CheckpointWriteError(code if code is not None else errno.EIO, message)


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for a directory written as a sharded (DCP) checkpoint."""
    p = Path(path)
    return p.is_dir() and (p / TRAINER_STATE).is_file() and (p / ".metadata").is_file()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_crc_lock = threading.Lock()


def _torch_save_without_crc(state: Any, out: DurableFile) -> None:
    # torch's switch is global: torch.save reads it when it opens its writer, before it writes a
    # byte. It is put back at the first write (the lock keeps two of our writers from restoring it
    # under each other), so a user's own torch.save in another thread would skip its checksums only
    # if it opened its writer in that instant (harmless: torch.load ignores them).
    _crc_lock.acquire()
    previous = torch.serialization.get_crc32_options()
    restored = False

    def restore() -> None:
        nonlocal restored
        if not restored:
            restored = True
            torch.serialization.set_crc32_options(previous)
            _crc_lock.release()

    torch.serialization.set_crc32_options(False)
    out.on_first_write = restore
    try:
        torch.save(state, cast("IO[bytes]", out))  # a DurableFile: the binary-file methods torch.save uses
    finally:
        restore()


def _save_durably(state: Any, tmp: Path, crc32: bool) -> None:
    """`torch.save(state)` into `tmp`, on disk when this returns (with torch's own zip checksums
    unless `crc32` is False)."""
    can_switch = hasattr(torch.serialization, "set_crc32_options")
    out = DurableFile(tmp)  # written back to disk while torch.save is still serialising
    try:
        if crc32 or not can_switch:
            torch.save(state, cast("IO[bytes]", out))  # a DurableFile: the binary-file methods torch.save uses
        else:
            _torch_save_without_crc(state, out)
    except BaseException as exc:
        out.abort()
        _raise_write_error(out, exc)
        raise
    out.close()  # fsync: durable before it becomes visible under its real name


def _raise_write_error(out: DurableFile, exc: BaseException) -> None:
    """A write that failed mid-file surfaces from torch.save as a RuntimeError of its own ("unexpected
    pos ..."): raise the OSError the disk gave instead (ENOSPC names the real problem)."""
    err = out.write_error
    if err is not None and not isinstance(exc, OSError):
        raise OSError(err.errno, err.strerror or str(err)) from exc


def atomic_save(state: Any, path: str | os.PathLike[str], crc32: bool = True) -> Path:
    """`torch.save(state)` to `path` so that readers only ever see a complete file.

    `crc32=False` leaves the zip checksums out (`config.checkpoint_crc32`): faster, and torch.load
    reads the file the same, but zip tools and pickle scanners reject it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _save_durably(state, tmp, crc32)
            _replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    except CheckpointWriteError:
        raise
    except OSError as exc:
        raise write_failure(path, exc) from exc
    _fsync_dir(path.parent)
    return path


def _replace(new: Path, path: Path) -> None:
    """`os.replace(new, path)`, also where `path` is a directory (a sharded checkpoint of the same
    name, written under another strategy): that one is moved aside first and deleted after."""
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        os.replace(new, path)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(new, path)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file, or a sharded checkpoint's directory; gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def move_aside_file(path: Path) -> Path | None:
    """Before a sharded checkpoint (a directory) is written at `path`: move a file or symlink of that
    name (written under another strategy) to a hidden name; returns it, for the caller to delete once
    the directory is in place (None when there was nothing to move)."""
    if not (path.is_symlink() or path.is_file()):
        return None
    aside = path.with_name(f".{path.name}.replaced")
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside)
    os.replace(path, aside)
    return aside


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint file safely; `CheckpointError` names the file and what is wrong with it.

    The file is trusted only once verified (`dream_trainer.utils.checkpoint_verify`): its bytes against
    their CRC-32 records before anything is unpickled, then its sections and the finiteness of its
    weights; `DamagedCheckpoint` names the file and the part that failed.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {str(path)!r}")
    if not _looks_like_torch_file(path):
        # torch would call any unpickling failure "Weights only load failed": say what it is.
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint (not a file torch.save wrote); pass a .ckpt file this "
            "trainer saved, or a run's checkpoints/last.ckpt"
        )
    if zipfile.is_zipfile(path) and not verified.verify_bytes(path):
        verified.note_unverified(path)
    state = _load(path)
    verified.verify_sections(path, state, with_tensors=path.name != TRAINER_STATE)
    verified.verify_finite(path, state)
    return state


def _load(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):  # not a torch archive at all
            raise CheckpointError(
                f"cannot read checkpoint {str(path)!r}: it is truncated or not a checkpoint ({exc!r})"
            ) from exc
        # weights_only refused an object: the file holds something other than plain state. Torch's
        # message is pages long; its one line that names the object is what helps.
        reason = next((line for line in str(exc).splitlines() if "WeightsUnpickler error" in line), str(exc))
        raise CheckpointError(
            f"refused to load {str(path)!r}: it contains objects that are not plain tensors/containers "
            f"and loading them could run code ({reason.strip()})"
        ) from exc
    except Exception as exc:  # torch's readers raise many types for torn or foreign files
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r}: it is truncated or not a checkpoint ({exc!r})"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(state).__name__}, not a checkpoint dict")
    return state


def _looks_like_torch_file(path: Path) -> bool:
    """Starts like a zip archive (torch.save's format since 1.6) or a pickle (protocol 2+: 0x80). A
    truncated checkpoint still starts like one: torch's reader then says it is torn."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def point_last(directory: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Make `directory/last.ckpt` name the same file as `target`, atomically.

    A hard link: it costs no copy, loads like any checkpoint, and keeps the data alive if rotation
    later deletes `target`. Falls back to an atomic copy where hard links are not supported.
    """
    directory, target = Path(directory), Path(target)
    last = directory / LAST_NAME
    if NONFINITE_TAG in target.name:
        raise CheckpointError(f"refusing to point {str(last)!r} at {str(target)!r}: its weights are not finite")
    if target.resolve() == last.resolve():
        return last
    try:
        return _point_last(directory, target, last)
    except OSError as exc:
        raise write_failure(last, exc) from exc


def _point_last(directory: Path, target: Path, last: Path) -> Path:
    tmp = directory / f".{LAST_NAME}.tmp-{os.getpid()}-{threading.get_ident()}"
    if target.is_dir():  # a sharded checkpoint: a relative symlink, replaced atomically
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(target.name, tmp)
        _replace(tmp, last)
        _fsync_dir(directory)
        return last
    try:
        try:
            os.link(target, tmp)
        except OSError:
            with open(target, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        _replace(tmp, last)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(directory)
    return last


_STEP_RE = re.compile(r"step=(\d+)")
EXCEPTION_TAG = "-exception"  # ModelCheckpoint(save_on_exception=True): the state when fit() failed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime  # follows last.ckpt's symlink (sharded checkpoints)
    except OSError:
        return -1.0


def _newest_first(directory: Path) -> list[Path]:
    """The checkpoints in `directory` but `last.ckpt`, newest first: by the step in their name, then by
    time; files written when a run failed (`-exception`) only after every other one."""
    files = [
        p
        for p in directory.glob(f"*{SUFFIX}")
        if not p.name.startswith(".")
        and p.name != LAST_NAME
        and NONFINITE_TAG not in p.name
        and (p.is_file() or p.is_dir())
    ]

    def key(p: Path) -> tuple[bool, int, float]:
        m = _STEP_RE.search(p.name)
        return (EXCEPTION_TAG not in p.name, int(m.group(1)) if m else -1, _mtime(p))

    return sorted(files, key=key, reverse=True)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _candidates(directory: Path) -> list[Path]:
    """Every checkpoint of `directory` in the order "last" tries them: the newest first, whatever
    `last.ckpt` names. A run killed after writing a checkpoint and before moving `last.ckpt` to it
    resumes from that newer file. `last.ckpt` is tried just before the file it names (a hard link or
    a symlink), or, when it names none of them (written directly, or its file was rotated away), by
    the time it was written."""
    named = _newest_first(directory)
    last = directory / LAST_NAME
    if not (last.exists() or last.is_symlink()):
        return named
    for i, p in enumerate(named):
        if _same_file(last, p):
            return [*named[:i], last, *named[i:]]
    written = _mtime(last)
    at = next((i for i, p in enumerate(named) if EXCEPTION_TAG in p.name or _mtime(p) <= written), len(named))
    return [*named[:at], last, *named[at:]]


def find_last(directory: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that is verified: by the step in its name, then by time;
    `last.ckpt` where it stands among them (see `_candidates`), so that a newer file than the one it
    names is never passed over.

    A torn or damaged file (`read_checkpoint` verifies each) is never chosen: one warning names it, the
    part that failed and the file chosen instead. Returns `(path, state)` so the file is read once, or
    None when the directory holds no valid checkpoint.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    failed: list[Path] = []  # `last.ckpt` is a hard link to a checkpoint: one warning per file
    skipped: list[str] = []
    candidates = _candidates(directory)
    found: tuple[Path, dict[str, Any]] | None = None
    for path in candidates:
        if any(_same_file(path, f) for f in failed):
            continue
        try:
            if path.is_dir():
                if not is_sharded_checkpoint(path):
                    raise CheckpointError(f"{str(path)!r} is a directory but not a complete sharded checkpoint")
                found = path, read_checkpoint(path / TRAINER_STATE)
            else:
                found = path, read_checkpoint(path)
            break
        except CheckpointError as exc:
            failed.append(path)
            aliases = [p.name for p in candidates if p != path and _same_file(p, path)]
            also = f" (the same file as {', '.join(aliases)})" if aliases else ""
            skipped.append(f"{_first_sentence(str(exc))}{also}")
    if skipped:
        instead = f"; using {str(found[0])!r} instead" if found is not None else "; no other checkpoint there"
        warn_user(f"skipping {len(skipped)} unusable checkpoint(s): {'; '.join(skipped)}{instead}")
    return found


def _first_sentence(text: str) -> str:
    """An error's first line, without the reader's own paragraph (torch adds one, in parentheses)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    cuts = [i for i in (line.find(" ("), line.find(". ")) if i > 0]
    return line[: min(cuts)] if cuts else line[:250]


def detached_cpu_copy(state: Any, reuse: Any = None) -> Any:
    """A copy of `state` whose tensors are on the CPU and share nothing with the live ones.

    `reuse` is an earlier copy no longer in use: tensors of the same shape and dtype at the same
    place are overwritten in place instead of allocated again (a fresh allocation of a large state
    costs several times the copy itself).
    """
    if isinstance(state, torch.Tensor):
        if isinstance(reuse, torch.Tensor) and reuse.shape == state.shape and reuse.dtype == state.dtype:
            return reuse.copy_(state.detach())
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: detached_cpu_copy(v, old.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        old_items = list(reuse) if isinstance(reuse, (list, tuple)) and len(reuse) == len(state) else []
        items = [detached_cpu_copy(v, old_items[i] if old_items else None) for i, v in enumerate(state)]
        if hasattr(state, "_fields"):
            return type(state)(*items)
        return items if isinstance(state, list) else type(state)(items)
    return state


class AsyncWriter:
    """Runs checkpoint file work on one background thread, in submission order.

    `submit` first waits for earlier work (so at most one state copy is in memory); `then` queues
    follow-up work (pointing `last.ckpt`, deleting rotated files) behind it without blocking, so
    nothing is deleted before the new file is durable. `wait` blocks until everything queued is
    done and raises the first error, so a failed background save is never silent.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []

    @property
    def pending(self) -> bool:
        """True while queued work has not been waited for."""
        return bool(self._pending)

    def submit(self, fn: Any, *args: Any) -> None:
        self.wait()
        self.then(fn, *args)

    def then(self, fn: Any, *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dream-ckpt")
        before = list(self._pending)

        def after_success() -> Any:
            for future in before:  # done already (one worker, in order); re-raises a failed write,
                future.result()  # so nothing is linked to or deleted after a write that did not land
            return fn(*args)

        self._pending.append(self._pool.submit(after_success))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise CheckpointError(f"a background checkpoint write failed: {error!r}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def model_mismatch(saved: dict[str, Any], live: dict[str, Any]) -> tuple[str, bool, list[str]]:
    """How a model's saved state differs from the live model's `state_dict()`: a short summary (counts),
    whether tensors have another shape (which `strict=False` cannot load), and one line per difference,
    for the lines below an error's first one."""
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    reshaped = [
        k
        for k in live
        if k in saved
        and isinstance(live[k], torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and live[k].shape != saved[k].shape
    ]
    parts, details = [], []
    if reshaped:
        parts.append(f"{len(reshaped)} tensor(s) of another shape")
        details += [
            f"  another shape: {k}: {_shape(saved[k])} in the checkpoint, {_shape(live[k])} here" for k in reshaped
        ]
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint")
        details += [f"  missing from the checkpoint: {k}" for k in missing]
    if unexpected:
        parts.append(f"{len(unexpected)} not in this model")
        details += [f"  not in this model: {k}" for k in unexpected]
    return ", ".join(parts), bool(reshaped), details

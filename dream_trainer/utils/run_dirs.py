"""Run directories: one per run, claimed atomically, never shared, never written by a later run.

```
<root_dir>/
  version_0/            a run (`trainer.run_dir`): the next free version_N, or `run_name`
    run.json            who created it, when, from which checkpoint; resumes; how it ended
    config.yaml         the config the run started with
    checkpoints/        ModelCheckpoint's files, last.ckpt (`trainer.checkpoint_dir`)
    events..., metrics.csv, hparams.json, images/, profiler/   the loggers' files (`trainer.log_dir`)
    .lock               held (flock) by the process training (or evaluating) the run
  version_1/
  checkpoints/, logs/   the layout of earlier versions: read by "last" when no run exists, never written
```

A directory is claimed with `os.mkdir`, which fails when the name exists, so two processes started
at once can never claim the same one (the loser takes the next name). The process that trains a run
holds an exclusive `flock` on its `.lock` file for as long as it trains, which the kernel releases
when the process dies, however it dies: a run in use is never adopted by a second process. Children
it forks (DataLoader workers) close their copy of the lock's descriptor at once, so a killed run's
workers, which outlive it by a few seconds, never keep it locked; `exec` closes it too (close-on-exec).

A run's `run.json` is written only by the process that holds its lock. A run killed outright (SIGKILL,
OOM, a lost node) cannot say how it ended: the next run claimed or continued in the same `root_dir`
finds its record still "running" with its lock free, takes the lock, marks it "killed" and removes
the partial files its last save left (`settle_dead_runs`). The process that continues a run also
removes the temporary files of the run directory itself whose writer is gone (`remove_stray_files`).

A run whose `run.json` is gone (deleted, lost) but whose checkpoints are not is still a run
(`record_lost`): `runs_newest_first` lists it among the others, and the process that continues it
writes a new record saying so (`rebuilt_record`).

Nothing here knows about the trainer; `dream_trainer.mixins.logging` and `.checkpoint` use it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import sys
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dream_trainer.utils.replace_file import replace_text
from dream_trainer.utils.stall_dump import parse_pending_name

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"
CHECKPOINTS = "checkpoints"
LEGACY_NAMES = frozenset({"checkpoints", "logs"})  # <root_dir>/checkpoints and /logs: the old layout
_VERSION_RE = re.compile(r"^version_(\d+)$")


class RunInUseError(RuntimeError):
    """The run directory is locked by another live process."""


def now() -> str:
    """The local time, ISO 8601 with its offset, to the second (for run records)."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def is_run_dir(path: Path) -> bool:
    """True for a directory a run created (it holds `run.json`)."""
    return (path / RUN_FILE).is_file()


def record_lost(path: Path) -> bool:
    """True for a run directory whose `run.json` is gone but whose checkpoints are not: it holds what
    only a run writes (`config.yaml`, or the `.lock` every run takes) and a checkpoint in `checkpoints/`.
    The mark keeps another tool's `checkpoints/` folder (a Lightning `version_N`) from passing for a run."""
    return (
        path.name not in LEGACY_NAMES
        and not (path / RUN_FILE).exists()
        and ((path / CONFIG_FILE).is_file() or (path / LOCK_FILE).is_file())
        and newest_checkpoint_time(path) >= 0
    )


def file_time(path: Path) -> str | None:
    """`path`'s modification time as run records write times (None when it cannot be read)."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    return datetime.datetime.fromtimestamp(mtime).astimezone().isoformat(timespec="seconds")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one owned by another user counts). Where that
    cannot be told (Windows, where `os.kill` would end it), True: a file it may write is kept."""
    if sys.platform == "win32" or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, another user's
        return True
    return True


def family_of(name: str | None) -> re.Pattern[str]:
    """The names a run named `name` may have: `name`, `name-v1`, `name-v2`, ... (None: version_N)."""
    if name is None:
        return _VERSION_RE
    return re.compile(rf"^{re.escape(name)}(-v\d+)?$")


def _candidates(root: Path, name: str | None) -> Any:
    if name is None:
        taken = [int(m.group(1)) for p in _listdir(root) if (m := _VERSION_RE.match(p))]
        n = max(taken) + 1 if taken else 0
        while True:
            yield f"version_{n}"
            n += 1
    yield name
    taken = [int(m.group(1)) for p in _listdir(root) if (m := re.match(rf"^{re.escape(name)}-v(\d+)$", p))]
    k = max(taken) + 1 if taken else 1
    while True:
        yield f"{name}-v{k}"
        k += 1


def _listdir(root: Path) -> list[str]:
    try:
        return os.listdir(root)
    except FileNotFoundError:
        return []


def claim_run_dir(root: Path, name: str | None) -> Path:
    """Create and return a new run directory under `root`: the next free `version_N` (name None), or
    `name`, then `name-v1`, `name-v2`, ... when taken. `os.mkdir` is exclusive: of two processes that
    try one name at once, one gets it and the other moves on. Raises `OSError` when `root` cannot be
    written (permission denied, read-only, disk full)."""
    root.mkdir(parents=True, exist_ok=True)
    for candidate in _candidates(root, name):
        path = root / candidate
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")  # pragma: no cover - the candidates never run out


def next_free_run_dir(root: Path, name: str | None) -> Path:
    """The directory `claim_run_dir` would create now, without creating it."""
    return next(root / c for c in _candidates(root, name) if not (root / c).exists())


def check_writable(root: Path) -> None:
    """Raise `OSError` (EACCES, EROFS, ENOSPC, ...) now when `root` (created if missing) does not
    take a new entry: before any model is built, rather than at the first save."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(probe)
    os.rmdir(probe)


def read_record(run_dir: Path) -> dict[str, Any]:
    """The run's `run.json` ({} when missing or unreadable)."""
    try:
        data = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


_RECORD_TMP_RE = re.compile(rf"^\.{re.escape(RUN_FILE)}\.tmp-(\d+)$")  # write_record's temporary file


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Replace `run.json` atomically (a reader sees the old record or the new one). On a full disk the
    record is written over the old one in place instead: how a run ended is still recorded."""
    text = json.dumps(record, indent=2, default=str) + "\n"
    replace_text(run_dir / RUN_FILE, text, run_dir / f".{RUN_FILE}.tmp-{os.getpid()}", in_place_when_full=True)


def new_record(name: str, **fields: Any) -> dict[str, Any]:
    """The first `run.json` of a run: who made it, where, when, with what command."""
    return {
        "name": name,
        "created": now(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": " ".join([os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python", *sys.argv[1:]]),
        **fields,
        "resumes": [],
        "status": "running",
    }


def rebuilt_record(run_dir: Path, why: str) -> dict[str, Any]:
    """A `run.json` for a run whose own is gone (`why`: "missing", "unreadable"), from what its directory
    still tells: its name and path, when it was created (`config.yaml`'s time, None without it), and when
    and why it was rebuilt. Its history (command, host, earlier resumes and how they ended) is lost; its
    status is "unknown" until a process trains it."""
    return {
        "name": run_dir.name,
        "run_dir": os.path.abspath(run_dir),
        "created": file_time(run_dir / CONFIG_FILE),
        "rebuilt": now(),
        "note": f"rebuilt: run.json was {why}",
        "resumes": [],
        "status": "unknown",
    }


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    """`config.yaml`: the config the run started with, as YAML (the format of the CLI's `--config` files)."""
    import yaml

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: a tenth of the pure-Python time
    if not _plain(config):  # a user field holding an object: write what YAML can say about it
        config = {k: v if _plain(v) else repr(v) for k, v in config.items()}
    (run_dir / CONFIG_FILE).write_text(yaml.dump(config, Dumper=dumper, sort_keys=False))


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()  # the locks this process holds


def _close_held_locks_in_child() -> None:
    # A forked child (a DataLoader worker) shares the parent's open file description, and with it the
    # flock: closing the child's descriptor leaves the parent's lock in place, and the lock dies with
    # the parent however the children outlive it.
    for lock in list(_HELD):
        lock._forget_in_child()


_fork_hook_registered = False


def _register_fork_hook() -> None:
    """Once per process, when it first holds a lock: a program that never takes one gets no at-fork hook."""
    global _fork_hook_registered
    if not _fork_hook_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_held_locks_in_child)
        _fork_hook_registered = True


class RunLock:
    """An exclusive `flock` on `<run_dir>/.lock`, held while a process trains the run.

    The kernel drops it when the process exits or is killed, so a crashed run is free to resume at
    once: the descriptor is close-on-exec, and forked children (DataLoader workers) close their copy
    when they start, so none of them keeps the lock after its parent died. Where `fcntl` does not
    exist (Windows) it holds nothing. The holder writes its pid and host into the file, so the error
    another process gets can name it.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock, or raise `RunInUseError` naming the process that holds it."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise RunInUseError(holder) from None
        except BaseException:
            f.close()
            raise
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n")
        f.flush()
        self._file = f
        _register_fork_hook()
        _HELD.add(self)

    def try_acquire(self) -> bool:
        """Take the lock if it is free (True); False when a live process holds it."""
        try:
            self.acquire()
        except RunInUseError:
            return False
        return True

    def _forget_in_child(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # the child's descriptor only: the parent's lock stays
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        _HELD.discard(self)
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # closing the file releases the flock
            self._file = None

    def __del__(self) -> None:
        self.release()


def lock_holder(run_dir: Path) -> str | None:
    """Who holds the run's lock (the line its holder wrote: pid, host, since when), or None when no
    live process holds it. Only looks: a shared lock taken and dropped at once, the file unchanged."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no locks, nothing can be told
        return None
    try:
        f = open(run_dir / LOCK_FILE)  # noqa: SIM115 - closed below
    except OSError:
        return None  # never locked (or unreadable): nobody holds it
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
        except OSError:
            return None
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def newest_checkpoint_time(run_dir: Path) -> float:
    """When the run last wrote a checkpoint (mtime of `checkpoints/last.ckpt` or the newest file);
    runs without one sort by their record's time, after every run that has one."""
    directory = run_dir / CHECKPOINTS
    times = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
                continue
            with contextlib.suppress(OSError):
                times.append(entry.stat().st_mtime)  # follows last.ckpt's symlink (sharded runs)
    if times:
        return max(times)
    return -1.0


def runs_newest_first(root: Path, name: str | None = None) -> list[Path]:
    """The run directories under `root` (of the family of `name` when given: `name`, `name-v1`, ...),
    the one that wrote a checkpoint most recently first; runs whose `run.json` is lost among them
    (`record_lost`), in their place."""
    pattern = family_of(name) if name is not None else None
    runs = []
    for entry in _listdir(root):
        if entry.startswith(".") or (pattern is not None and not pattern.match(entry)):
            continue
        path = root / entry
        if path.is_dir() and (is_run_dir(path) or record_lost(path)):
            runs.append(path)
    with_time = [(newest_checkpoint_time(p), p) for p in runs]
    return [p for _, p in sorted(with_time, key=lambda tp: (tp[0], tp[1].name), reverse=True)]


def _left_by_interrupted_save(entry: str) -> bool:
    return entry.startswith(".") and re.search(r"\.(tmp(-\d+-\d+)?|old|replaced)$", entry) is not None


def remove_partial_files(directory: Path, is_partial: Callable[[str], bool] = _left_by_interrupted_save) -> list[str]:
    """Delete what an interrupted save leaves in a run's own checkpoint directory (hidden temporary
    files and directories: `.NAME.tmp-PID-TID`, `.NAME.tmp`, `.NAME.old`, `.NAME.replaced`), or the
    entries `is_partial` names. Only call it while holding the run's lock: no live process writes there
    then. Returns the names removed."""
    import shutil

    removed = []
    for entry in _listdir(directory):
        if not is_partial(entry):
            continue
        path = directory / entry
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(entry)
    return removed


def remove_stray_files(run_dir: Path) -> list[str]:
    """Delete the temporary files a killed process left in the run directory itself: `.run.json.tmp-PID`
    (a record being written) and the hang watchdog's empty `.hang-stacks-rank<R>-<host>-<pid>.pending`
    (`dream_trainer.utils.stall_dump`), each only when its pid no longer runs on this host (another
    host's is kept: its process cannot be seen from here). A pending file holding stacks is kept: the
    stacks of a rank stuck in C code that no other rank collected. Only call it while holding the run's
    lock. Returns the names removed."""

    def stray(entry: str) -> bool:
        # A pid that still runs here may be the writer (or, its pid reused, another process: keeping the
        # file is harmless). run.json is written only by the lock's holder: with the lock held, a pid
        # gone from this host is no writer.
        if (m := _RECORD_TMP_RE.match(entry)) is not None:
            return not pid_alive(int(m.group(1)))
        pending = parse_pending_name(entry)
        if pending is None:
            return False
        _, host, pid = pending
        return host == socket.gethostname() and not pid_alive(pid) and _is_empty(run_dir / entry)

    return remove_partial_files(run_dir, stray)


def _is_empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


def abandon_if_unused(run_dir: Path) -> bool:
    """Remove a run directory this process claimed but never used (it holds only the run's own
    bookkeeping files); True if it was removed."""
    keep = {RUN_FILE, CONFIG_FILE, LOCK_FILE}
    try:
        entries = os.listdir(run_dir)
    except OSError:
        return False
    if any(e not in keep for e in entries):
        return False
    with contextlib.suppress(OSError):
        for e in entries:
            (run_dir / e).unlink()
        run_dir.rmdir()
        return True
    return False


def settle_dead_runs(root: Path, skip: Path | None = None) -> list[str]:
    """Runs under `root` whose `run.json` says "running" but whose lock is free died without saying
    so (SIGKILL, out of memory): for each, take its lock, mark it "killed" (with any resume still
    open), remove the partial files its interrupted save left in its `checkpoints/`, and release it.
    A run held by a live process is left alone. Returns the names of the runs settled."""
    settled = []
    for entry in _listdir(root):
        path = root / entry
        if entry.startswith(".") or (skip is not None and path == skip) or not is_run_dir(path):
            continue
        record = read_record(path)
        open_resume = any(isinstance(r, dict) and "outcome" not in r for r in record.get("resumes") or [])
        if record.get("status") != "running" and not open_resume:
            continue
        lock = RunLock(path)
        with contextlib.suppress(OSError):
            if not lock.try_acquire():
                continue
        try:
            record = read_record(path)  # again, under the lock: the owner may have ended it meanwhile
            changed = mark_killed(record)
            with contextlib.suppress(OSError):
                if changed:
                    write_record(path, record)
                remove_partial_files(path / CHECKPOINTS)
                settled.append(entry)
        finally:
            lock.release()
    return settled


def mark_killed(record: dict[str, Any]) -> bool:
    """Mark a dead run's record: "running" -> "killed", and resumes without an outcome "killed"."""
    changed = False
    for resume in record.get("resumes") or []:
        if isinstance(resume, dict) and "outcome" not in resume:
            resume["outcome"] = "killed"
            changed = True
    if record.get("status") == "running":
        record.update(status="killed", killed_noticed=now())  # when a later run found it dead, not when it died
        changed = True
    return changed

"""`RunMirror`: the run directory's copy in the store, written by one background thread on global rank zero.

The run writes its local directory exactly as without a mirror (atomic checkpoint files, run.json, the loggers'
files); this object copies it. `publish(path)` is called once a checkpoint is complete on disk (after a
background save's write: `CheckpointMixin.after_checkpoint_write`) and only queues the upload, so a step is
blocked no longer than by a local save. The thread uploads the checkpoint's parts, then its commit marker
(`dream_trainer.mirror.commit`); every `sync_every_s`, after each checkpoint and at the end it copies the
other files that changed (before a checkpoint's marker: a committed checkpoint's logs are in the store). A
checkpoint this process saw in the store and on disk and that is gone from disk
(rotated by `save_top_k`, a signal checkpoint replaced) is deleted from the store, marker first: only this run's
own keys are ever deleted. `close()` at the end of a fit waits for the queue (`flush_timeout_s`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dream_trainer.mirror.commit import MARKER, Commit, Part
from dream_trainer.mirror.setting import MirrorConfig
from dream_trainer.mirror.store import Store, StoreError
from dream_trainer.utils.checkpoint_io import LAST_NAME, SUFFIX
from dream_trainer.utils.run_dirs import CHECKPOINTS

_STOP = object()
_SYNC = object()


class RunMirror:
    """The copy of one run directory at a time in the store (`attach` at each fit's start, `close` at its end)."""

    def __init__(self, config: MirrorConfig, store_factory: Callable[[MirrorConfig], Store] = Store) -> None:
        self.config = config
        self._store_factory = store_factory
        self._store: Store | None = None
        self._run_dir: Path | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self._synced: dict[str, tuple[int, int]] = {}  # file key -> (size, mtime_ns) uploaded
        self._known: dict[str, tuple[str, ...]] = {}  # checkpoint key -> its part keys: committed, on disk
        self._warned_outside = False
        self.last_committed: str | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = self._store_factory(self.config)
        return self._store

    @property
    def attached(self) -> bool:
        """A fit's run is being copied (between `attach` and `close`)."""
        return self._thread is not None

    def counts(self) -> dict[str, Any]:
        """run.json's "mirror": the URL, what was uploaded, retried and failed, the newest committed checkpoint."""
        counts = dict(self._store.counts) if self._store is not None else {}
        return {"url": self.config.url, **counts, "last_committed": self.last_committed}

    # --- the fit's run --------------------------------------------------------------------------------------------
    def attach(self, run_dir: Path) -> None:
        """The run this process writes from now on: start the thread; checkpoints on disk the store lacks (a run
        continued on the machine that wrote it, whose last upload did not finish) are queued for upload."""
        self._run_dir = run_dir
        self._synced, self._known, self.last_committed = {}, {}, None  # what is known of this run only
        name = run_dir.name
        listing = self.store.listing(name)
        for key, size in listing.items():
            local = run_dir.parent / key
            with contextlib.suppress(OSError):
                st = local.stat()
                if st.st_size == size and not key.endswith(MARKER):
                    self._synced[key] = (st.st_size, st.st_mtime_ns)
        committed = {k[: -len(MARKER)] for k in listing if k.endswith(MARKER)}
        for key in committed:
            local = run_dir.parent / key
            if local.exists():
                parts = (key,) if local.is_file() else tuple(k for k in listing if k.startswith(key + "/"))
                self._known[key] = parts
                self.last_committed = key
        self._start()
        for path in self._local_checkpoints(run_dir / CHECKPOINTS):
            if self._key(path) not in committed:
                self.publish(path)

    def publish(self, path: str | os.PathLike[str]) -> None:
        """A checkpoint is complete on disk at `path`: queue its upload (returns at once)."""
        path = Path(path)
        if self._run_dir is None or not _inside(path, self._run_dir):
            if not self._warned_outside:
                self._say(
                    f"mirror: {str(path)!r} is outside the run directory ({self._run_dir}), so it is not copied to "
                    f"{self.config.url}; leave ModelCheckpoint's dirpath unset to mirror checkpoints"
                )
                self._warned_outside = True
            return
        self._put(path)

    def close(self, deadline: float | None = None) -> bool:
        """End of a fit: the uploads still queued, then the other files, until `deadline` (`time.monotonic()`;
        None: `flush_timeout_s` from now); the thread stops. False (with a line saying what is left, and where
        the local copy is) when time ran out."""
        if self._thread is None:
            return True
        if deadline is None:
            deadline = time.monotonic() + self.config.flush_timeout_s
        self._put(_SYNC)
        done = self.drain(deadline - time.monotonic())
        self._queue.put(_STOP)
        if done:
            self._thread.join(timeout=5.0)
        else:
            self._say(
                f"mirror: uploads to {self.config.url} not finished after {self.config.flush_timeout_s:g} s "
                f"(flush_timeout_s); the local copy is complete in {self._run_dir}, and the next fit of this run "
                "from that directory uploads what is missing"
            )
        self._thread = None
        return done

    def drain(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until everything queued so far is done; True when it is."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # --- the thread -----------------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        # Each thread reads its own queue: one left behind by a close that timed out ends with its own stop.
        self._queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._work, args=(self._queue,), name="dream_trainer-mirror", daemon=True
        )
        self._thread.start()

    def _put(self, item: Any) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(item)

    def _work(self, tasks: queue.Queue[Any]) -> None:
        while True:
            try:
                item = tasks.get(timeout=self.config.sync_every_s)
            except queue.Empty:
                item = _SYNC
                with self._idle:
                    self._pending += 1
            if item is _STOP:
                return
            try:
                if item is not _SYNC:
                    self._upload_checkpoint(item)
                self._forget_deleted()
                self._sync_files()
            except StoreError as exc:
                self._say(f"mirror: {exc}")
            except Exception as exc:  # the thread must go on; the error is said, never swallowed
                self._say(f"mirror: {type(exc).__name__}: {exc}")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _upload_checkpoint(self, path: Path) -> None:
        key = self._key(path)
        store = self.store
        if key in self._known:  # the name is written again (last.ckpt saved directly): its old marker goes first
            store.delete(key + MARKER)
            del self._known[key]
        try:
            mtime = path.stat().st_mtime
            files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*") if p.is_file())
            parts = []
            for f in files:
                with open(f, "rb") as source:  # this file's bytes even if a later save replaces the name
                    part = self._key(f)
                    size, crc = store.put_stream(part, source)
                parts.append(Part(part, size, crc))
        except FileNotFoundError:
            return  # rotated away before it was uploaded: nothing to publish
        except StoreError as exc:
            self._say(
                f"mirror: {key} was not uploaded ({exc}); the local copy stays in {path}, and the next fit of this "
                "run from this directory uploads it"
            )
            return
        # The logs up to this checkpoint first (the loggers flushed before it was written): a run continued from
        # it on another machine finds its history complete (the rows logged after it are dropped on resume).
        self._sync_files()
        commit = Commit(key, tuple(parts), mtime, path.is_dir())
        store.put_bytes(commit.marker, commit.encode())  # written last: the checkpoint is visible from here on
        self._known[key] = tuple(p.key for p in parts)
        self.last_committed = key

    def _forget_deleted(self) -> None:
        """Checkpoints committed here and since deleted from disk (rotation): deleted from the store, marker first,
        so no reader finds a marker whose parts are going."""
        assert self._run_dir is not None
        for key, parts in list(self._known.items()):
            if (self._run_dir.parent / key).exists():
                continue
            self.store.delete(key + MARKER)
            for part in parts:
                self.store.delete(part)
            del self._known[key]
            if self.last_committed == key:
                self.last_committed = None

    def _sync_files(self) -> None:
        """The run's other files (run.json, config.yaml, logs, ...) that changed since their last upload."""
        run_dir = self._run_dir
        assert run_dir is not None
        for path in sorted(run_dir.rglob("*")):
            rel = path.relative_to(run_dir)
            if rel.parts[0] == CHECKPOINTS or any(part.startswith(".") for part in rel.parts):
                continue
            try:
                st = path.stat()
                if not path.is_file() or path.is_symlink():
                    continue
                key = self._key(path)
                if self._synced.get(key) == (st.st_size, st.st_mtime_ns):
                    continue
                with open(path, "rb") as source:
                    self.store.put_stream(key, source)
            except FileNotFoundError:
                continue
            self._synced[key] = (st.st_size, st.st_mtime_ns)

    # --- helpers --------------------------------------------------------------------------------------------------
    def _key(self, path: Path) -> str:
        """`path`'s key: relative to the mirror's URL as it is to `root_dir` ("<run>/checkpoints/<name>")."""
        assert self._run_dir is not None
        root = self._run_dir.parent
        try:
            return path.relative_to(root).as_posix()
        except ValueError:  # the same place spelled another way (a symlink in one of them)
            return path.resolve().relative_to(root.resolve()).as_posix()

    @staticmethod
    def _local_checkpoints(directory: Path) -> list[Path]:
        """The complete checkpoints in `directory` (temporary and hidden names are partial writes), `last.ckpt`
        only when it is not a link to one of them."""
        if not directory.is_dir():
            return []
        named = [p for p in directory.iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith(".")]
        others = [p for p in named if p.name != LAST_NAME]
        last = directory / LAST_NAME
        if last in named and not last.is_symlink() and not any(_same_file(last, p) for p in others):
            others.append(last)
        return sorted(others)

    @staticmethod
    def _say(line: str) -> None:
        print(f"dream_trainer: {line}", file=sys.stderr, flush=True)


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False

"""`Store`: the object store under a mirror's URL, through fsspec, each operation retried with backoff.

Every call names a key relative to the mirror's URL ("version_0/checkpoints/last.ckpt"). Transient failures
(throttling, a 5xx, a reset connection, a timeout) are retried `retries` times, waiting `backoff_s`, then twice as
long each time (at most 30 s, with jitter); the store's own client retries are turned off where fsspec lets us
(S3), so that each retry is one we count. What still fails after that raises `StoreError`.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

from dream_trainer.mirror.setting import MirrorConfig

_T = TypeVar("_T")
_CHUNK = 8 << 20
_MAX_WAIT_S = 30.0


class StoreError(OSError):
    """An operation on the store failed after its retries (or at once, where retrying cannot help)."""


def _client_options(protocol: str) -> dict[str, Any]:
    """Options for the store's file system: botocore's own retries off (S3), so each retry is ours and counted;
    a local directory makes the folders a key needs."""
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
    if protocol in ("file", "local"):
        return {"auto_mkdir": True}
    return {}


def _permanent(exc: BaseException) -> bool:
    """Failures no retry changes: no such bucket or key, no permission, a bad request."""
    return isinstance(exc, (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, ValueError))


class Store:
    """The store a mirror writes to and restores from (thread-safe: fsspec's file systems are)."""

    def __init__(self, config: MirrorConfig, sleep: Callable[[float], None] = time.sleep) -> None:
        import fsspec  # imported when a mirror is used

        self.config = config
        self.root = config.url.split("://", 1)[1].rstrip("/")
        # An instance of our own (fsspec caches them): its retry setting is changed below, for no one else.
        self.fs = fsspec.filesystem(config.protocol, skip_instance_cache=True, **_client_options(config.protocol))
        if hasattr(self.fs, "retries"):
            self.fs.retries = 1  # s3fs retries throttling and resets itself otherwise, uncounted
        self._sleep = sleep
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {"uploaded": 0, "uploaded_bytes": 0, "downloaded": 0, "deleted": 0,
                                       "retries": 0, "failures": 0}  # fmt: skip

    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    # --- retried operations ------------------------------------------------------------------------------------
    def attempt(self, what: str, fn: Callable[[], _T]) -> _T:
        """`fn()`, retried on transient failures with backoff; `StoreError` naming `what` when it keeps failing."""
        tries = self.config.retries + 1
        for k in range(tries):
            try:
                return fn()
            except Exception as exc:  # classified below: the store's clients raise many kinds
                if _permanent(exc) or k == tries - 1:
                    self.count("failures")
                    raise StoreError(f"{what}: {type(exc).__name__}: {exc}".strip()) from exc
                self.count("retries")
                wait = min(_MAX_WAIT_S, self.config.backoff_s * 2**k)
                self._sleep(wait * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    def put_stream(self, rel: str, source: IO[bytes]) -> tuple[int, int]:
        """Write the bytes of `source` (from its current position) to `rel`; returns (size, CRC-32) of what was
        written, computed as it is sent (one pass). A store without rename shows the object only once it is
        complete (a multipart upload is invisible until finished), so a reader never sees part of it."""
        start = source.tell()

        def put() -> tuple[int, int]:
            source.seek(start)
            size = crc = 0
            with self.fs.open(self.key(rel), "wb") as out:
                while chunk := source.read(_CHUNK):
                    out.write(chunk)
                    size += len(chunk)
                    crc = zlib.crc32(chunk, crc)
            return size, crc

        size, crc = self.attempt(f"upload {rel}", put)
        self.count("uploaded")
        self.count("uploaded_bytes", size)
        return size, crc

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.attempt(f"upload {rel}", lambda: self.fs.pipe_file(self.key(rel), data))
        self.count("uploaded")
        self.count("uploaded_bytes", len(data))

    def get_bytes(self, rel: str) -> bytes:
        data: bytes = self.attempt(f"download {rel}", lambda: self.fs.cat_file(self.key(rel)))
        self.count("downloaded")
        return data

    def get_stream(self, rel: str, sink: Callable[[Iterator[bytes]], _T]) -> _T:
        """`sink(chunks)` over the object's bytes, retried whole (the sink starts again each time)."""

        def get() -> _T:
            with self.fs.open(self.key(rel), "rb") as f:
                return sink(iter(lambda: f.read(_CHUNK), b""))

        value = self.attempt(f"download {rel}", get)
        self.count("downloaded")
        return value

    def delete(self, rel: str) -> None:
        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.key(rel))

        self.attempt(f"delete {rel}", rm)
        self.count("deleted")

    def listing(self, rel: str = "") -> dict[str, int]:
        """Every object under `rel` (recursively): its key relative to the mirror's URL -> its size."""

        def find() -> dict[str, Any]:
            try:
                found: dict[str, Any] = self.fs.find(self.key(rel), detail=True)
            except FileNotFoundError:
                return {}
            return found

        found = self.attempt(f"list {rel or self.config.url}", find)
        self.fs.invalidate_cache()  # the next listing sees what was written since
        prefix = self.root + "/"
        return {k[len(prefix) :]: int(v.get("size") or 0) for k, v in found.items() if k.startswith(prefix)}

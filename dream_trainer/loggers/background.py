"""A logger's writes, run on a worker thread so the training loop never waits for a backend.

Experiment trackers (MLflow, W&B) write over the network or through a service process: tens of
microseconds to seconds per call. `BackgroundWriter` takes items on the training thread (an append to
a deque and a length check) and hands them, in order and in batches, to the logger's `write` function
on one worker thread per logger. The worker wakes every `interval` seconds, when `flush()` or
`close()` asks, or when the queue is half full, so a logger called every step costs one wake-up per
interval, not one per step, and one backend call carries many steps.

The queue is bounded (`max_pending` items): when the backend falls that far behind, `submit` waits
for room rather than dropping values or growing without limit. An exception raised by `write` is
kept and raised once, on the training thread, by the next `submit`, `flush` or `close`, as a
`LoggerWriteError` naming the logger and the cause; the items of the failed batch are lost, later
ones are still written.
"""

from __future__ import annotations

import atexit
import collections
import sys
import threading
from collections.abc import Callable
from typing import Any

from dream_trainer.errors import DreamTrainerError

__all__ = ["BackgroundWriter", "LoggerWriteError"]


class LoggerWriteError(DreamTrainerError, RuntimeError):
    """A logger's background write failed; raised on the training thread at the logger's next call."""


class BackgroundWriter:
    """One worker thread that calls `write(items)` with the items `submit` queued, oldest first.

    Args:
        name: the logger's name, used in the thread's name and in errors (e.g. `"MLFlowLogger"`).
        write: called on the worker thread with a non-empty list of items, in submission order.
        interval: the longest, in seconds, a submitted item waits before the worker picks it up.
        max_pending: the most items queued; `submit` waits when the worker is this far behind.

    `submit`, `flush` and `close` are meant to be called from one thread (the trainer's). After
    `close`, a `submit` starts a new worker.
    """

    def __init__(
        self,
        name: str,
        write: Callable[[list[Any]], None],
        *,
        interval: float = 1.0,
        max_pending: int = 10_000,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"{name}: interval={interval!r} must be > 0 seconds")
        if max_pending < 2:
            raise ValueError(f"{name}: max_pending={max_pending!r} must be at least 2")
        self.name = name
        self.interval = interval
        self.max_pending = max_pending
        self._write = write
        self._items: collections.deque[Any] = collections.deque()
        self._wake_at = max_pending // 2  # wake the worker early, before submit would have to wait
        self._wake = threading.Event()
        self._progress = threading.Condition()  # notified after every batch (flush and a full queue wait on it)
        self._submitted = 0
        self._written = 0  # items handed to `write` (written or lost to an error)
        self._error: BaseException | None = None
        self._more_errors = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- the training thread ----------------------------------------------------------------------
    def submit(self, item: Any) -> None:
        """Queue `item` for the worker (starting it on first use). Raises a pending `LoggerWriteError`."""
        if self._error is not None:
            self.raise_pending()
        if self._thread is None:
            self._start()
        items = self._items
        if len(items) >= self.max_pending:  # the backend is behind: wait for room (values are never dropped)
            self._wake.set()
            with self._progress:
                self._progress.wait_for(lambda: len(items) < self.max_pending or not self._alive())
        items.append(item)
        self._submitted += 1
        if len(items) >= self._wake_at:
            self._wake.set()

    def flush(self) -> None:
        """Wait until everything submitted so far has been written; raise a pending `LoggerWriteError`."""
        if self._thread is not None:
            target = self._submitted
            self._wake.set()
            with self._progress:
                self._progress.wait_for(lambda: self._written >= target or not self._alive())
        self.raise_pending()

    def close(self, *, raise_errors: bool = True) -> None:
        """Write what is queued, stop the worker. With `raise_errors=False` (the failure path, where the
        run's own error must not be hidden) a write error is printed on stderr instead of raised."""
        self._stopping = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wake.set()
            thread.join()
            atexit.unregister(self._close_at_exit)
        self._stopping = False  # a later submit starts a new worker (a second fit() with the same logger)
        if raise_errors:
            self.raise_pending()
        elif self._error is not None:
            try:
                self.raise_pending()
            except LoggerWriteError as exc:
                print(f"dream_trainer: {exc}", file=sys.stderr)

    def raise_pending(self) -> None:
        """Raise the kept write error as a `LoggerWriteError` (once), if there is one."""
        error, more, self._error, self._more_errors = self._error, self._more_errors, None, 0
        if error is None:
            return
        also = f" ({more} later batch{'es' if more > 1 else ''} failed too)" if more else ""
        # The cause's first line is this error's (a logger that knows the fix puts it there); the rest below.
        first, _, rest = str(error).strip().partition("\n")
        lines = [f"{self.name}: a background write failed: {type(error).__name__}: {first}{also}"]
        if rest.strip():
            lines.append(rest.strip())
        lines.append(
            "The values of that batch were not written; check the backend (server address, credentials, disk)."
        )
        raise LoggerWriteError("\n".join(lines)) from error

    @property
    def pending(self) -> int:
        """Items submitted but not yet handed to `write`."""
        return self._submitted - self._written

    # --- the worker -------------------------------------------------------------------------------
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"dream_trainer-{self.name}", daemon=True)
        self._thread.start()
        # A logger never finalized (a script that logs outside fit()) still gets its values written.
        atexit.register(self._close_at_exit)

    def _close_at_exit(self) -> None:
        self.close(raise_errors=False)

    def _alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _run(self) -> None:
        items, wake = self._items, self._wake
        while True:
            wake.wait(self.interval)
            wake.clear()
            stopping = self._stopping  # read before draining: what was submitted before close() is written
            batch = []
            while items:
                batch.append(items.popleft())
            if batch:
                try:
                    self._write(batch)
                except BaseException as exc:  # kept for the training thread: a dead worker would hang flush()
                    if self._error is None:
                        self._error = exc
                    else:
                        self._more_errors += 1
                with self._progress:
                    self._written += len(batch)
                    self._progress.notify_all()
            if stopping and not items:
                return

"""The c10d store as the watchdog's two protocols use it: requests that never overlap a fork, and the bell.

The hang watch (`dream_trainer.utils.hang_watch`) and the stop agreement
(`dream_trainer.utils.stop_agreement`) talk to the other ranks through one store, under the fit's prefix,
and share two things, both here:

- **The fork guard.** A fork (a DataLoader starting its workers) never happens while the watchdog
  thread is inside a store request: the child would inherit the store client's locks held by a thread
  it does not have, and a loader worker deadlocked at its start (seen under load: the main thread
  waiting for its workers' first answer). Each request holds `FORK_GUARD`; a fork takes it first and
  both sides release it after. That at-fork hook is process-wide, so it is registered by the first
  watchdog to start (`guard_forks`), never by an import: a program that never starts a watchdog forks
  unhooked.
- **The bell.** Every write the other ranks must see rings it (`WatchStore.ring`: one counter). The
  watchdog's thread reads that one counter per tick (`WatchStore.bell`) and lets each protocol look at
  its own keys only when it changed, so a quiet run makes one store request per tick.
"""

from __future__ import annotations

import os
import threading
from typing import Any

FORK_GUARD = threading.Lock()
"""Held by each store request of the watchdog (and its faulthandler timer's re-arming); a fork waits for it
once `guard_forks` ran."""
_REGISTERING = threading.Lock()
_guarded = False  # `guard_forks` registered the at-fork hook (inherited by a forked child, as the hook is)

BELL = "bell"  # incremented by every write the other ranks must see


def guard_forks() -> None:
    """Make every later fork of this process wait for `FORK_GUARD` (`os.register_at_fork`; POSIX).
    Called by each watchdog as it starts; registers once per process."""
    global _guarded
    with _REGISTERING:
        if _guarded or not hasattr(os, "register_at_fork"):
            return
        os.register_at_fork(
            before=FORK_GUARD.acquire, after_in_parent=FORK_GUARD.release, after_in_child=FORK_GUARD.release
        )
        _guarded = True


class WatchStore:
    """A c10d store's requests, each one under `FORK_GUARD` (no fork while one is in flight), and the bell."""

    def __init__(self, store: Any) -> None:
        self._inner = store

    def add(self, key: str, amount: int) -> int:
        with FORK_GUARD:
            return int(self._inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        with FORK_GUARD:
            return bool(self._inner.check(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with FORK_GUARD:
            return self._inner.compare_set(key, expected, desired)

    def get(self, key: str) -> bytes:
        with FORK_GUARD:
            return self._inner.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        with FORK_GUARD:
            self._inner.set(key, value)

    def ring(self) -> None:
        """Tell every rank's thread to look at the keys: something it must see was written."""
        self.add(BELL, 1)

    def bell(self) -> int:
        """How many times the bell rang (one request: what a tick reads when nothing happens)."""
        return self.add(BELL, 0)

    def cas_max(self, key: str, value: int) -> None:
        """`store[key] = max(store[key], value)`, atomically (compare-and-set until it holds)."""
        current = self.compare_set(key, "", str(value)).decode()
        while int(current) < value:
            current = self.compare_set(key, current, str(value)).decode()

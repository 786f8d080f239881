"""Where a process's main thread is: what the training loop marks, and the hang watchdog reads.

The main thread marks on the hot path (two attribute stores, no I/O, no lock); the watchdog's thread
(`dream_trainer.utils.watchdog_thread`) reads the marks to tell progress, and its hang watch
(`dream_trainer.utils.hang_watch`) compares how far each rank got. Nothing here starts anything.
"""

from __future__ import annotations


class Heartbeat:
    """Where this process's main thread is: `where` (a hook, a step, "fetching batch", ...), `marks`
    (every mark counts one) and `batches` (training batches started). Written by the main thread on
    the hot path, read by the watchdog thread."""

    __slots__ = ("batch_mark", "batches", "marks", "where")

    def __init__(self) -> None:
        self.where = "setup"
        self.marks = 0
        self.batches = 0
        self.batch_mark = 0  # `marks` when the running batch started

    def mark(self, where: str) -> None:
        self.where = where
        self.marks += 1

    def start_batch(self, where: str) -> None:
        """A training batch starts (every rank starts the same batches, in the same order)."""
        self.where = where
        self.marks += 1
        self.batches += 1
        self.batch_mark = self.marks

    def position(self) -> tuple[int, int]:
        """How far the main thread went: batches started, marks since. Every rank passes the same marks
        in the same order, so a rank with a smaller position is behind."""
        return self.batches, self.marks - self.batch_mark

"""RollbackMixin: `spike_policy="rollback"` and the batches the loader drops (`config.skip_batches`).

With "rollback" the loop keeps an in-memory snapshot (`trainer.snapshot()`) at the start of each epoch's
batches and every `spike_snapshot_every` steps, and the batches fetched since it. At each snapshot point,
and before a batch boundary with work queued (a checkpoint is never written from weights a spike
reached), it reads the detector once (one device sync per `spike_snapshot_every` steps); on a spike it
restores the snapshot, adds the bad batch to the skip list and trains again on the kept batches without
it: the run continues as one whose loader never yielded that batch. See docs/bad-batches.md.

Under DDP every rank reads at the same points (they depend on the step count, the epoch's end and the
boundary's work, which a checkpoint save queues on every rank), and the read agrees (`_read_spike`: one
all-reduce of one integer): every rank restores its own snapshot of the same step (the replicas' states
are identical) and trains again on the same batch indices without the same one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from dream_trainer.mixins.batch_end import BatchEndMixin
from dream_trainer.mixins.snapshot import RunSnapshot, SnapshotMixin


class RollbackMixin(SnapshotMixin, BatchEndMixin):
    """The rollback's snapshot, its kept batches, and the replay after a spike."""

    def _init_rollback(self) -> None:
        self._rollback_on: bool = self.config.spike_policy == "rollback"
        self._rollback_every: int = self.config.spike_snapshot_every
        self._rollback_point: RunSnapshot | None = None
        self._kept_batches: list[tuple[int, Any]] = []  # fetched since the snapshot, in order
        self._replay: list[tuple[int, Any, bool]] = []  # to train on again after a rollback (True: drop it)

    def _filtered_batches(self, numbered: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
        """`numbered` ((batch_idx, batch) of the epoch) without the batches the skip list names (each is
        fetched, counted as done, and dropped), with the rollback's kept batches and replays."""
        loop = self._loop
        drop = self._batches_to_drop(loop.epoch)
        if self._rollback_on:
            self._take_rollback_point()
        source = iter(numbered)
        while True:
            if self._replay:
                batch_idx, batch, dropped = self._replay.pop(0)
                if dropped:  # the spike's batch: fetched once already, never trained on again
                    loop.drop_batch()
                    continue
            else:
                item = next(source, None)
                if item is None:
                    if self._rollback_on and self._rollback_check(final=True):
                        continue  # a spike in the epoch's last steps: train on again from the snapshot
                    return
                batch_idx, batch = item
            if drop is not None and batch_idx in drop:
                loop.drop_batch()  # a resume's position counts it: the loader yielded it
                continue
            if self._rollback_on:
                self._kept_batches.append((batch_idx, batch))
            yield batch_idx, batch

    def _take_rollback_point(self) -> None:
        self._rollback_point = self.snapshot()
        self._kept_batches.clear()

    def _rollback_check(self, final: bool = False) -> bool:
        """After a batch (before its boundary's work): at a snapshot point, or before queued work, read the
        detector; on a spike, roll back (True), else move the snapshot here. Nothing inside a window."""
        loop = self._loop
        if loop.window_pos != 0 or self._rollback_point is None:
            return False
        due = final or loop.global_step % self._rollback_every == 0 or bool(self._boundary_work)
        if not due:
            return False
        # SYNC: once per spike_snapshot_every steps (and before a save); with several processes, one
        # all-reduce of one integer, so that every rank rolls back past the same batch
        spike = self._read_spike()
        if spike is None:
            if not final:
                self._take_rollback_point()
            return False
        found, ranks = spike
        epoch, batch_idx, _ = found
        self._note_spike(found, "rolled back", ranks)
        self._record_skipped("spike", [found], ranks)
        replay = [(i, batch, loop.epoch == epoch and i == batch_idx) for i, batch in self._kept_batches]
        self.restore(self._rollback_point)
        self._reset_batch_boundary()  # what the undone steps asked for there: the replay asks again
        self._replay = replay + self._replay
        self._kept_batches.clear()
        return True

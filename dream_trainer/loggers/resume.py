"""What a logger keeps of its run's history when the run resumes from a checkpoint at step N.

The process that wrote the checkpoint went on logging until it stopped: every row it logged for a
step after N is stale, since the resumed run trains those steps again and logs them anew. Rows of
step N itself are of two kinds. Those logged before the checkpoint was written are not logged
again; those logged after it at the same step (a checkpoint written at the end of an epoch's last
batch comes before that epoch's validation and its means) are logged again by the resumed run. A
file logger therefore drops the rows after step N (`resume_split`) and holds those of step N in a
`ResumeBoundary`, where each row the resumed run logs at step N replaces the held row with the same
metric names: the history then holds every step, and every metric at it, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

R = TypeVar("R")


def resume_split(steps: Sequence[int], step: int) -> tuple[int, int]:
    """`(start, end)` for the rows of a file whose steps are `steps`, resuming at `step`: rows `[:start]`
    are kept, rows `[start:end]` are those of `step` at the end of the file (a `ResumeBoundary`'s),
    rows `[end:]` are stale (logged after the checkpoint for later steps).

    Only the file's tail is looked at: rows of an earlier run that wrote into the same file (a logger
    given the same `save_dir`) come before it and are kept whatever their steps.
    """
    end = len(steps)
    while end and steps[end - 1] > step:
        end -= 1
    start = end
    while start and steps[start - 1] == step:
        start -= 1
    return start, end


class ResumeBoundary(Generic[R]):
    """The rows a logger held at the resume step, reconciled with the rows the resumed run logs there.

    Each row logged at the resume step replaces the first held row with the same metric names; the held
    rows nobody replaced are kept. `add` returns what to write now: nothing while the resumed run is
    still at the resume step, then (at the first row of a later step) the kept rows, the new rows of
    the resume step and that row, in this order. `release` returns what is still held (at a flush).
    """

    def __init__(self, step: int, held: Sequence[tuple[frozenset[str], R]]) -> None:
        self.step = step
        self._held = list(held)
        self._new: list[R] = []

    def add(self, names: frozenset[str], row: R, step: int) -> list[R]:
        """The rows to write now that `row` (with the metrics `names`, at `step`) was logged."""
        if step == self.step:
            for i, (held_names, _) in enumerate(self._held):
                if held_names == names:
                    del self._held[i]
                    break
            self._new.append(row)
            return []
        return [*self.release(), row]

    def release(self) -> list[R]:
        """Every row still held: the kept ones, then the new ones of the resume step."""
        rows = [row for _, row in self._held] + self._new
        self._held, self._new = [], []
        return rows

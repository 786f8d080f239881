"""What a logger keeps of its run's history when the run resumes from a checkpoint at step N.

The process that wrote the checkpoint went on logging until it stopped: every row it logged for a
step after N is stale, since the resumed run trains those steps again and logs them anew. Rows of
step N itself are of two kinds. Those logged before the checkpoint was written are not logged
again; those logged after it at the same step (a checkpoint written at the end of an epoch's last
batch comes before that epoch's validation and its means) are logged again by the resumed run. A
file logger therefore drops the rows after step N (`resume_split`) and holds those of step N in a
`ResumeBoundary`, where each row the resumed run logs at step N replaces the held row with the same
metric names: the history then holds every step, and every metric at it, once.

An experiment tracker's run (MLflow, W&B) cannot drop what it holds: its logger continues the same
tracker run (`recorded_run_id`) and sends only the values that run does not hold yet
(`AlreadyLogged`), so there the stopped process's values of the steps after N are the ones kept.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from dream_trainer.utils.replace_file import replace_text

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


# --- experiment trackers (MLflow, W&B) ---------------------------------------------------------------
# A tracker's run lives on its server (or in its own files): a resumed run logs into the same tracker
# run, whose id the first process kept in the run directory. What the tracker already holds cannot be
# removed (MLflow's metric history and W&B's history rows are append-only), so the resumed run sends
# only what the tracker does not hold yet: each value it logs again at a step the tracker already has a
# value for (logged by the stopped process after the checkpoint) is counted off the `AlreadyLogged`
# record of the run instead of being sent.

TRACKERS_FILE = "trackers.json"  # in the run directory: {tracker: {key: run id}}
_trackers_lock = threading.Lock()  # two tracker loggers of one run record their ids from their threads


def recorded_run_id(run_dir: Path, tracker: str, key: str) -> str | None:
    """The id `record_run_id` kept for `tracker` (e.g. `"mlflow"`) and `key` (which server, project or
    experiment) in `run_dir`, or None."""
    with _trackers_lock:
        record = _read_trackers(Path(run_dir) / TRACKERS_FILE)
    run_id = record.get(tracker, {}).get(key)
    return run_id if isinstance(run_id, str) else None


def record_run_id(run_dir: Path, tracker: str, key: str, run_id: str) -> None:
    """Keep `run_id` as the tracker run of the dream_trainer run in `run_dir` (`<run_dir>/trackers.json`),
    for a resumed run to continue it."""
    path = Path(run_dir) / TRACKERS_FILE
    with _trackers_lock:
        record = _read_trackers(path)
        runs = record.setdefault(tracker, {})
        if runs.get(key) == run_id:
            return
        runs[key] = run_id
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n", path.with_name(f".{TRACKERS_FILE}.tmp"))


def _read_trackers(path: Path) -> dict[str, dict[str, Any]]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet (or unreadable: the next record rewrites it)
        return {}
    return {k: v for k, v in record.items() if isinstance(v, dict)} if isinstance(record, dict) else {}


K = TypeVar("K", bound=Hashable)


class AlreadyLogged(Generic[K]):
    """What a tracker's run holds at the steps a resumed run logs again: `skip(item)` is True (and
    counts it off) for each item the run already holds, so each is in the run once.

    An item is whatever identifies one value (MLflow: `(metric, step)`; W&B: `(step, metric names)` of
    a history row). Items held `n` times skip the first `n` times they are logged again; the others are
    sent. One case stays uncounted: an item logged at the checkpoint's own step both before the
    checkpoint and after it, where the stopped process died between the two (the second is then
    taken for the first).
    """

    def __init__(self, items: Iterable[K] = ()) -> None:
        self._held: Counter[K] = Counter(items)

    def skip(self, item: K) -> bool:
        """True when the run holds `item` already (it is then counted off): do not send it."""
        n = self._held.get(item, 0)
        if n == 0:
            return False
        if n == 1:
            del self._held[item]
        else:
            self._held[item] = n - 1
        return True


class TrackerContinuation:
    """When a tracker logger counts what its run holds (`AlreadyLogged`), and from which step.

    - `resume(step)` was called (a resumed run): when the run is opened, from `step`;
    - the logger ended the run before and a later `fit()` (same trainer) reopens it: at the first value, if
      that value's step comes before the last step the logger sent (the fit trains steps again, from a
      checkpoint), from that step. A `validate()` or a fit that continues logs at the last step or later,
      and everything it logs is sent.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Another dream_trainer run uses the logger: nothing of the previous one applies."""
        self.resume_step: int | None = None  # set by the logger's `resume(step)`
        self.ended = False  # the logger ended the tracker's run once
        self.last_step: int | None = None  # the latest step of a value the logger handled
        self._count_from: int | None = None
        self._check_replay = False

    def opened(self, existing: bool) -> int | None:
        """The tracker's run was opened (`existing`: one that holds values already); returns the resume step."""
        step, self.resume_step = self.resume_step, None
        self._count_from = step if existing else None
        self._check_replay = existing and step is None and self.ended
        return step

    def count_from(self, step: int) -> int | None:
        """Called with each value's step before it is sent: the step from which to count what the run
        holds (once), else None."""
        start = None
        if self._check_replay:
            self._check_replay = False
            if self.last_step is not None and step < self.last_step:
                start = step
        if self._count_from is not None:
            start, self._count_from = self._count_from, None
        if self.last_step is None or step > self.last_step:
            self.last_step = step
        return start

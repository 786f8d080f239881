"""Loss spikes: a running statistic of recent losses, and skip lists.

`SpikeDetector.check(loss, where)` only keeps the loss (detached, on its device) and where it came from:
no tensor operation, no read-back, so a step pays nothing measurable for it. The statistic is evaluated on
the host where the trainer decides (`read()`: every step for "skip", every few steps for "rollback", at
logging points for "warn"): the losses kept since the last evaluation are read back in one transfer (the
one sync) and compared, in order, each with the last `window` losses before it, so the position recorded
is the bad batch's own, however late it is read. Spikes are left out of the statistic (replaced by the
mean so far), so one bad batch does not raise the threshold for the next. Several ranks that check their
losses in step agree on one spike: `first_index()` is the index to reduce (a minimum over the ranks),
`take(index)` its position.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

Where = tuple[int, int, int]  # (epoch, batch_idx, global_step) of one checked loss


class SpikeDetector:
    """Mean + k·std of the last `window` losses (std at least 1% of |mean|); NaN/inf is always a spike."""

    def __init__(self, threshold: float, window: int, warmup: int) -> None:
        self.threshold = float(threshold)
        self.window = int(window)
        self.warmup = int(warmup)
        self._history: deque[float] = deque()  # the statistic's losses, oldest first, at most `window`
        self._sum = self._sum_sq = 0.0  # running sums of `_history` (part of the state: resumes bit-exact)
        self._pending: list[torch.Tensor] = []  # checked, not yet evaluated (on the loss's device)
        self._where: list[Where] = []  # the position of every loss checked since the last read
        self._evaluated = 0  # how many of `_where` the statistic has taken in
        self._first: int | None = None  # index into `_where` of the first spike since the last read

    def check(self, loss: torch.Tensor, where: Where) -> None:
        """Keep `loss` (a scalar) for the next evaluation: no tensor operation but the detach, no sync."""
        self._pending.append(loss.detach())
        self._where.append(where)

    def _evaluate(self) -> None:
        """SYNC: the kept losses, read back in one transfer, join the statistic in order."""
        if not self._pending:
            return
        pending = self._pending
        try:
            values = torch.stack(pending).reshape(-1).tolist()  # the usual case: 0-d losses of one dtype
        except RuntimeError:  # shapes (1,) and () mixed
            values = torch.stack([t.reshape(()).float() for t in pending]).tolist()
        self._pending = []
        history, k, window = self._history, self.threshold, self.window
        total, total_sq = self._sum, self._sum_sq
        for i, v in enumerate(values, self._evaluated):
            n = len(history)
            mean = total / n if n else 0.0
            bad = not math.isfinite(v)
            if not bad and n >= self.warmup:
                std = math.sqrt(max(total_sq / n - mean * mean, 0.0))
                bad = v > mean + k * max(std, 0.01 * abs(mean))
            if bad and self._first is None:
                self._first = i
            kept = mean if bad else v  # a spike does not enter the statistic: the mean so far stands in
            history.append(kept)
            total, total_sq = total + kept, total_sq + kept * kept
            if n == window:
                old = history.popleft()
                total, total_sq = total - old, total_sq - old * old
        self._sum, self._sum_sq = total, total_sq
        self._evaluated += len(values)

    def read(self) -> Where | None:
        """The position of the first spike since the last read, or None; then forget the positions.
        SYNC: one device-to-host read of the losses checked since the last evaluation."""
        self._evaluate()
        return self.take(self._first)

    def first_index(self, none: int, device: torch.device) -> torch.Tensor:
        """The index of the first spike since the last read among the losses checked since, `none` when
        there is none, as a 0-d long tensor on `device` (SYNC: the evaluation). Several ranks check their
        losses in step, so the smallest index over the ranks is the first spike on any rank (`take` it)."""
        self._evaluate()
        return torch.tensor(none if self._first is None else self._first, dtype=torch.long, device=device)

    def take(self, index: int | None) -> Where | None:
        """The position of checked loss `index` (None, or out of range: none); then forget the positions
        (the losses stay in the statistic)."""
        self._evaluate()
        found = self._where[index] if index is not None and 0 <= index < len(self._where) else None
        self._where, self._evaluated, self._first = [], 0, None
        return found

    # --- state (a checkpoint resumes the statistic; a snapshot puts it back exactly) --------------------
    def state_dict(self) -> dict[str, Any]:
        self._evaluate()  # every loss checked so far is part of the state (SYNC: a save reads anyway)
        return {"losses": list(self._history), "sums": [self._sum, self._sum_sq]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "losses" in state:
            losses = [float(v) for v in state["losses"]]
            sums = state.get("sums")
        else:  # the earlier format: a ring buffer (a tensor), `count` of it filled, `pos` the next slot
            ring = state.get("history")
            count, pos = int(state.get("count", 0)), int(state.get("pos", 0))
            values = [] if ring is None else ring.tolist()
            losses, sums = values[:count] if count < len(values) else values[pos:] + values[:pos], None
        if sums is None or len(losses) > self.window:  # (a resume with a smaller spike_window keeps the last)
            losses = losses[-self.window :]
            sums = [math.fsum(losses), math.fsum(x * x for x in losses)]
        self.put_state((losses, float(sums[0]), float(sums[1])))

    def copy_state(self) -> tuple[list[float], float, float]:
        self._evaluate()
        return list(self._history), self._sum, self._sum_sq

    def put_state(self, saved: tuple[list[float], float, float]) -> None:
        losses, self._sum, self._sum_sq = saved
        self._history = deque(losses)
        self._pending, self._where, self._evaluated, self._first = [], [], 0, None


def read_skip_list(value: Any) -> set[tuple[int, int]]:
    """`config.skip_batches` as a set of `(epoch, batch_idx)`: a list of pairs (or of the entries
    `trainer.skipped_batches` holds), or the path of a JSON file with such a list or a run.json."""
    if value is None:
        return set()
    if isinstance(value, (str, os.PathLike)):
        data = json.loads(Path(value).read_text(encoding="utf-8"))
        if isinstance(data, dict):
            data = data.get("skipped_batches", [])
        value = data
    return {_pair(item) for item in value}


def _pair(item: Any) -> tuple[int, int]:
    if isinstance(item, dict):
        return int(item["epoch"]), int(item["batch_idx"])
    epoch, batch_idx = item
    return int(epoch), int(batch_idx)


def pairs(entries: Iterable[dict[str, Any]]) -> set[tuple[int, int]]:
    return {(int(e["epoch"]), int(e["batch_idx"])) for e in entries}

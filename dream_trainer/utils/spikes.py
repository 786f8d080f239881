"""Loss spikes: a running statistic of recent losses kept on the loss's device, and skip lists.

`SpikeDetector.check(loss, where)` compares one loss with the last `window` ones without reading
anything back to the host: the flag is a 0-d bool tensor on the loss's device, and the detector keeps, on
that device, the index of the first flagged loss since it was last read. `read()` is the one read-back
(a device sync); the trainer calls it where it decides (every step for "skip", every few steps for
"rollback", at logging points for "warn"), so the position recorded is the bad batch's own, however late
it is read. Spikes are left out of the statistic (replaced by the mean so far), so one bad batch does
not raise the threshold for the next. Several ranks that check their losses in step agree on one
spike without reading it first: `first_index()` is the index to reduce (a minimum over the ranks),
`take(index)` its position.
"""

from __future__ import annotations

import json
import os
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
        self._history: torch.Tensor | None = None  # on the loss's device, created at the first check
        self._count = 0  # losses in the history (at most `window`)
        self._pos = 0  # where the next one goes (a ring)
        self._first: torch.Tensor | None = None  # index into `_where` of the first spike since `read()`, -1
        self._where: list[Where] = []

    def check(self, loss: torch.Tensor, where: Where) -> torch.Tensor:
        """Add `loss` (a scalar) and return whether it is a spike, as a device tensor: no sync."""
        v = loss.detach().reshape(()).float()
        if self._history is None or self._first is None or self._history.device != v.device:
            self._history = torch.zeros(self.window, device=v.device)
            self._first = torch.full((), -1, dtype=torch.long, device=v.device)
        bad = ~torch.isfinite(v)
        n = self._count
        mean = self._history[:n].sum() / max(n, 1)
        if n >= self.warmup:
            std = self._history[:n].std(correction=0)
            bad = bad | (v > mean + self.threshold * torch.maximum(std, 0.01 * mean.abs()))
        # A spike does not enter the statistic: the mean so far stands in for it.
        self._history[self._pos] = torch.where(bad, mean, v)
        self._pos = (self._pos + 1) % self.window
        self._count = min(n + 1, self.window)
        self._first = torch.where((self._first < 0) & bad, len(self._where), self._first)
        self._where.append(where)
        return bad

    def read(self) -> Where | None:
        """The position of the first spike since the last read, or None; then forget the positions.
        SYNC: one device-to-host read (none when nothing was checked since)."""
        if not self._where or self._first is None:
            return None
        return self.take(int(self._first))

    def first_index(self, none: int, device: torch.device) -> torch.Tensor:
        """The index of the first spike since the last read among the losses checked since, `none` when
        there is none, as a new 0-d long tensor (on the statistic's device, else `device`): no sync. Several
        ranks check their losses in step, so the smallest index over the ranks is the first spike on any
        rank (`take` it)."""
        if self._first is None:
            return torch.full((), none, dtype=torch.long, device=device)
        return torch.where(self._first < 0, none, self._first)

    def take(self, index: int | None) -> Where | None:
        """The position of checked loss `index` (None, or out of range: none); then forget the positions."""
        found = self._where[index] if index is not None and 0 <= index < len(self._where) else None
        if self._first is not None:
            self._first.fill_(-1)
        self._where = []
        return found

    # --- state (a checkpoint resumes the statistic; a snapshot puts it back exactly) --------------------
    def state_dict(self) -> dict[str, Any]:
        history = None if self._history is None else self._history.detach().to("cpu", copy=True)
        return {"history": history, "count": self._count, "pos": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = state.get("history")
        self._history = None if history is None else history.clone()
        self._first = None if history is None else torch.full((), -1, dtype=torch.long)
        self._count, self._pos = int(state.get("count", 0)), int(state.get("pos", 0))
        self._where = []

    def copy_state(self) -> tuple[torch.Tensor | None, int, int]:
        return (None if self._history is None else self._history.clone(), self._count, self._pos)

    def put_state(self, saved: tuple[torch.Tensor | None, int, int]) -> None:
        history, self._count, self._pos = saved
        self._history = None if history is None else history.clone()
        self._first = None if history is None else torch.full((), -1, dtype=torch.long, device=history.device)
        self._where = []


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

"""CSVLogger: one row per logging step in `metrics.csv`."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dream_trainer.loggers.base import Logger


class CSVLogger(Logger):
    """Writes `metrics.csv` (columns `step` and every metric seen) and `hparams.json`.

    Rows are buffered and the file is rewritten every `flush_every` rows and at the end, so a metric
    that first appears late still gets its own column (earlier rows leave it empty).
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, flush_every: int = 100) -> None:
        self.log_dir = Path(save_dir) if save_dir is not None else None
        self.flush_every = flush_every
        self.rows: list[dict[str, Any]] = []
        self._unflushed = 0

    @property
    def path(self) -> Path:
        """The CSV file."""
        assert self.log_dir is not None, "CSVLogger has no directory: pass save_dir or attach it to a trainer"
        return self.log_dir / "metrics.csv"

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self.path.parent / "hparams.json").write_text(json.dumps(dict(params), indent=2, default=str))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.rows.append({"step": step, **metrics})
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Rewrite the file with every row so far."""
        columns: dict[str, None] = {"step": None}
        for row in self.rows:
            columns.update(dict.fromkeys(row))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(".metrics.csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
        self._unflushed = 0

    def finalize(self, status: str) -> None:
        if self.rows or self._unflushed:
            self.flush()

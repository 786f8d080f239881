"""CSVLogger: one row per logging step in `metrics.csv`."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

from dream_trainer.loggers.metrics_file import MetricsFileLogger


class CSVLogger(MetricsFileLogger):
    """Writes `metrics.csv` (columns `step` and every metric seen) and `hparams.json`.

    Rows are buffered and appended every `flush_every` rows, at each checkpoint and at the end. When
    a metric first appears late the file is rewritten with the new column (earlier rows leave it
    empty), so every row has the same columns.
    """

    file_name = "metrics.csv"

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, flush_every: int = 100) -> None:
        super().__init__(save_dir)
        self.flush_every = flush_every
        self.rows: list[dict[str, Any]] = []
        self._unflushed = 0
        self._columns: dict[str, None] = {"step": None}  # ordered set: the header of the file as written
        self._written = 0  # rows already in the file

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.rows.append(self.row(metrics, step))
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the rows logged since the last flush (the whole file again if a column was added)."""
        new = self.rows[self._written :]
        n_columns = len(self._columns)
        for row in new:
            self._columns.update(dict.fromkeys(row))
        if self._written and len(self._columns) == n_columns and self.path.exists():
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=list(self._columns)).writerows(new)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(".metrics.csv.tmp")
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(self._columns))
                writer.writeheader()
                writer.writerows(self.rows)
            os.replace(tmp, self.path)
        self._written = len(self.rows)
        self._unflushed = 0

    def finalize(self, status: str) -> None:
        if self._written < len(self.rows):
            self.flush()

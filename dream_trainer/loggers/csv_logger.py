"""CSVLogger: one row per logging step in `metrics.csv`."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping
from typing import Any

from dream_trainer.loggers.metrics_file import MetricsFileLogger, parse_step
from dream_trainer.loggers.resume import ResumeBoundary, resume_split
from dream_trainer.utils.replace_file import naming, replace_text
from dream_trainer.utils.warn import warn_user


class CSVLogger(MetricsFileLogger):
    """Writes `metrics.csv` (columns `step` and every metric seen) and `hparams.json`.

    Rows are buffered and appended every `flush_every` rows, at each checkpoint and at the end. When
    a metric first appears late the file is rewritten with the new column (earlier rows leave it
    empty), so every row has the same columns. Rows already in the file are kept: a resumed run
    continues its history (the rows logged after its checkpoint are replaced by the resumed run's,
    see `dream_trainer.loggers.resume`), and a new run whose `save_dir` holds another run's file
    appends after its rows, with a warning.
    """

    file_name = "metrics.csv"

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, flush_every: int = 100) -> None:
        super().__init__(save_dir)
        self.flush_every = flush_every
        self.rows: list[dict[str, Any]] = []  # the rows this process logged (after a resume: from its step on)
        self._unflushed = 0
        self._columns: dict[str, None] = {"step": None}  # ordered set: the header of the file as written
        self._written = 0  # rows of `rows` already in the file
        self._previous: list[dict[str, str]] | None = None  # the file's rows from before this process
        self._boundary: ResumeBoundary[dict[str, Any]] | None = None

    def resume(self, step: int) -> None:
        if self.rows:  # a second fit() of the same trainer: what this process logged goes to the file first
            self.flush()
            self.rows, self._written = [], 0
        previous = self._read_file()
        start, end = resume_split([parse_step(row.get("step")) for row in previous], step)
        held = [(frozenset(k for k, v in row.items() if k != "step" and v), row) for row in previous[start:end]]
        self._previous = previous[:start]
        self._boundary = ResumeBoundary(step, held)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = self.row(metrics, step)
        if self._boundary is None:
            self.rows.append(row)
        else:
            self.rows += self._boundary.add(frozenset(metrics), row, step)
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self._write()  # rows held at a resume's step stay held until the run is past it

    def flush(self) -> None:
        """Write the rows logged since the last flush (the whole file again if a column was added)."""
        if self._boundary is not None:
            self.rows += self._boundary.release()
            self._boundary = None
        self._write()

    def _write(self) -> None:
        if self._previous is None:  # a new run: keep what another run wrote into this file
            self._previous = self._read_file()
            if self._previous:
                warn_user(
                    f"CSVLogger: {self.path} already holds {len(self._previous)} rows of another run; this run's "
                    "rows are appended after them. Give each run its own save_dir, or leave save_dir unset "
                    "(every run then writes into its own run directory)."
                )
        new = self.rows[self._written :]
        if not new and self.path.exists():
            return
        n_columns = len(self._columns)
        for row in new:
            self._columns.update(dict.fromkeys(row))
        if self._written and len(self._columns) == n_columns and self.path.exists():
            with naming(self.path), open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=list(self._columns)).writerows(new)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = io.StringIO(newline="")
            writer = csv.DictWriter(text, fieldnames=list(self._columns))
            writer.writeheader()
            writer.writerows(self._previous or [])
            writer.writerows(self.rows)
            replace_text(self.path, text.getvalue(), self.path.with_name(".metrics.csv.tmp"))
        self._written = len(self.rows)
        self._unflushed = 0

    def finalize(self, status: str) -> None:
        if self._boundary is not None or self._written < len(self.rows):
            self.flush()

    def _read_file(self) -> list[dict[str, str]]:
        """The rows of the file as it is (none when there is none); its columns become the header's first."""
        if self.log_dir is None or not self.path.exists():
            return []
        text = self.path.read_text()
        if not text.endswith("\n"):  # the last line of a write the process did not finish: dropped
            text = text[: text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = [row for row in reader if row.get("step")]
        header = reader.fieldnames or []
        self._columns = dict.fromkeys(["step", *header, *self._columns])
        return rows

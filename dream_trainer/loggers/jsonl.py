"""JSONLinesLogger: one JSON object per logging call in `metrics.jsonl`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import IO, Any

from dream_trainer.loggers.metrics_file import MetricsFileLogger, parse_step
from dream_trainer.loggers.resume import ResumeBoundary, resume_split
from dream_trainer.utils.replace_file import naming, replace_text


def _jsonable(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN/inf


class JSONLinesLogger(MetricsFileLogger):
    """Appends `{"step": s, "metric": value, ...}` lines to `metrics.jsonl` (easy to stream and parse);
    the config goes to `hparams.json`. Non-finite values are written as the strings "nan"/"inf".

    Lines already in the file are kept; a resumed run continues its history (the lines logged after
    its checkpoint are replaced by the resumed run's, see `dream_trainer.loggers.resume`).
    """

    file_name = "metrics.jsonl"

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(save_dir)
        self._file: IO[str] | None = None
        self._kept: list[str] | None = None  # after `resume`: the lines the file keeps, written at the boundary
        self._boundary: ResumeBoundary[str] | None = None

    def resume(self, step: int) -> None:
        lines = self._read_lines()
        rows: list[dict[str, Any]] = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            rows.append(row if isinstance(row, dict) else {})
        start, end = resume_split([parse_step(row.get("step")) for row in rows], step)
        pairs = zip(rows[start:end], lines[start:end], strict=True)
        held = [(frozenset(k for k in row if k != "step"), line) for row, line in pairs]
        self._kept = lines[:start]
        self._boundary = ResumeBoundary(step, held)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        line = json.dumps(self.row({k: _jsonable(v) for k, v in metrics.items()}, step))
        if self._boundary is None:
            self._write([line])
        else:
            lines = self._boundary.add(frozenset(metrics), line, step)
            if lines:
                self._end_boundary(lines)

    def flush(self) -> None:
        if self._boundary is not None:
            self._end_boundary(self._boundary.release())

    def finalize(self, status: str) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _end_boundary(self, lines: list[str]) -> None:
        """Rewrite the file: the lines it keeps, then `lines`; appends follow."""
        kept, self._kept, self._boundary = self._kept or [], None, None
        if self._file is not None:
            self._file.close()
            self._file = None
        text = "".join(line + "\n" for line in [*kept, *lines])
        replace_text(self.path, text, self.path.with_name(".metrics.jsonl.tmp"))

    def _write(self, lines: list[str]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held open across calls; line-buffered
        with naming(self.path):
            self._file.write("".join(line + "\n" for line in lines))

    def _read_lines(self) -> list[str]:
        if self.log_dir is None or not self.path.exists():
            return []
        text = self.path.read_text()
        if not text.endswith("\n"):  # the last line of a write the process did not finish: dropped
            text = text[: text.rfind("\n") + 1]
        return [line for line in text.split("\n") if line.strip()]

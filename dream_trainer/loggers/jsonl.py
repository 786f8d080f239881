"""JSONLinesLogger: one JSON object per logging call in `metrics.jsonl`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import IO

from dream_trainer.loggers.metrics_file import MetricsFileLogger


def _jsonable(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN/inf


class JSONLinesLogger(MetricsFileLogger):
    """Appends `{"step": s, "metric": value, ...}` lines to `metrics.jsonl` (easy to stream and parse);
    the config goes to `hparams.json`. Non-finite values are written as the strings "nan"/"inf"."""

    file_name = "metrics.jsonl"

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(save_dir)
        self._file: IO[str] | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held open across calls; line-buffered
        self._file.write(json.dumps(self.row({k: _jsonable(v) for k, v in metrics.items()}, step)) + "\n")

    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

"""JSONLinesLogger: one JSON object per logging call in `metrics.jsonl`."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from dream_trainer.loggers.base import Logger


def _jsonable(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no NaN/inf


class JSONLinesLogger(Logger):
    """Appends `{"step": s, "metric": value, ...}` lines to `metrics.jsonl` (easy to stream and parse);
    the config goes to `hparams.json`. Non-finite values are written as the strings "nan"/"inf"."""

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        self.log_dir = Path(save_dir) if save_dir is not None else None
        self._file: IO[str] | None = None

    @property
    def path(self) -> Path:
        """The JSON-lines file."""
        assert self.log_dir is not None, "JSONLinesLogger has no directory: pass save_dir or attach it to a trainer"
        return self.log_dir / "metrics.jsonl"

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self.path.parent / "hparams.json").write_text(json.dumps(dict(params), indent=2, default=str))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held open across calls; line-buffered
        self._file.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n")

    def finalize(self, status: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

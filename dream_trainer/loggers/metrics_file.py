"""What the CSV and JSON-lines loggers share: one row per logging call in a file of the run's log
directory, `{"step": step, **metrics}`, and the config in `hparams.json` beside it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from dream_trainer.loggers.base import Logger


def parse_step(value: Any) -> int:
    """The step of a row read back from a metrics file (`"8"`, `8`, `8.0`); -1 when it is not a number."""
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return -1


class MetricsFileLogger(Logger):
    """A logger that writes the rows of `row(metrics, step)` into `<log_dir>/<file_name>`.

    Subclasses set `file_name` and write the rows (`log_metrics`, `flush`, `finalize`) in their format.
    """

    file_name: ClassVar[str]

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        self.log_dir = Path(save_dir) if save_dir is not None else None

    @property
    def path(self) -> Path:
        """The metrics file."""
        assert self.log_dir is not None, (
            f"{type(self).__name__} has no directory: pass save_dir or attach it to a trainer"
        )
        return self.log_dir / self.file_name

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self.path.parent / "hparams.json").write_text(json.dumps(dict(params), indent=2, default=str))

    @staticmethod
    def row(metrics: Mapping[str, Any], step: int) -> dict[str, Any]:
        """One logging call's row: `step`, then the metrics in their order."""
        return {"step": step, **metrics}

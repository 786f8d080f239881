"""What the experiment-tracker loggers (MLflow, W&B) share: writes on a `BackgroundWriter`, the
backend's package imported on first use, the run's checkpoints uploaded when the run ends.

A tracker logger turns each call into an item for its worker thread:

- `("params", params)`: the run's config, once (`log_hyperparams`);
- `("metrics", step, metrics, wall_time)`: one logging call;
- `("images", tag, step, images)` and `("histogram", tag, step, values)`: CPU tensors;
- `("end", status, checkpoints)`: the run ended ("success"/"failed"), upload `checkpoints` first.

The subclass's `write(items)` sends them to its backend, on the worker thread, in order.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from dream_trainer.errors import ConfigError
from dream_trainer.loggers.background import BackgroundWriter
from dream_trainer.loggers.base import Logger
from dream_trainer.utils.checkpoint_io import LAST_NAME, SUFFIX
from dream_trainer.utils.run_dirs import CHECKPOINTS

CHECKPOINT_CHOICES = (False, "last", "all")


def import_backend(module: str, logger: str, extra: str) -> ModuleType:
    """Import the backend's package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise ModuleNotFoundError(f"{logger} needs {module}: pip install 'dream-trainer[{extra}]'") from exc
        raise


def checkpoints_to_upload(directory: Path, which: str | bool) -> list[Path]:
    """The checkpoints of `directory` a tracker uploads at the end of the run.

    `"last"`: `last.ckpt` (ModelCheckpoint's link to the newest file), else the newest `*.ckpt`;
    `"all"`: every `*.ckpt` file or sharded-checkpoint directory; `False`: none.
    """
    if not which or not directory.is_dir():
        return []
    found = sorted((p for p in directory.iterdir() if p.name.endswith(SUFFIX)), key=lambda p: p.name)
    if which == "all":
        return found
    last = directory / LAST_NAME
    if last.exists():
        return [last]
    return [max(found, key=lambda p: p.stat().st_mtime)] if found else []


class TrackerLogger(Logger):
    """Base of the loggers whose backend is an experiment tracker (`MLFlowLogger`, `WandbLogger`).

    Every call only queues an item (see the module's docstring); a worker thread per logger writes
    them. `flush()` waits until the queue is written, `finalize(status)` uploads the checkpoints, ends
    the backend's run and stops the worker. A failed write is raised, once, by the next call.

    Args:
        log_checkpoints: which checkpoints of the run to upload when it ends: `"last"` (the default;
            `True` means the same), `"all"` or `False`.
        checkpoint_dir: where those checkpoints are (default: `<run_dir>/checkpoints`, where
            `ModelCheckpoint` writes unless given a `dirpath`; pass that `dirpath` here).
        flush_secs: the longest a logged value waits before the worker sends it.
        max_pending: the most queued items; when the backend falls this far behind, logging waits.
    """

    backend: ClassVar[str]  # the module to import, e.g. "mlflow"
    extra: ClassVar[str]  # the pip extra that installs it

    def __init__(
        self,
        *,
        log_checkpoints: str | bool = "last",
        checkpoint_dir: str | os.PathLike[str] | None = None,
        flush_secs: float = 1.0,
        max_pending: int = 10_000,
    ) -> None:
        name = type(self).__name__
        if log_checkpoints is True:
            log_checkpoints = "last"
        if log_checkpoints not in CHECKPOINT_CHOICES:
            raise ConfigError(
                f"{name}(log_checkpoints={log_checkpoints!r}) is invalid: valid choices are 'last', 'all', False"
            )
        self.module = import_backend(self.backend, name, self.extra)  # fail at construction, not mid-run
        self.log_checkpoints: str | bool = log_checkpoints
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.run_dir: Path | None = None
        self._writer = BackgroundWriter(name, self.write, interval=flush_secs, max_pending=max_pending)

    def attach(self, log_dir: Path) -> None:
        """Remember the run's directory (its name names the tracker's run, its checkpoints are uploaded)."""
        self.run_dir = Path(log_dir)
        super().attach(log_dir)

    # --- the training thread: queue only ------------------------------------------------------------
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._writer.submit(("params", dict(params)))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._writer.submit(("metrics", step, dict(metrics), time.time()))

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        self._writer.submit(("images", tag, step, images))

    def log_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self._writer.submit(("histogram", tag, step, values))

    def flush(self) -> None:
        """Wait until every value logged so far is sent; raise a `LoggerWriteError` if a send failed."""
        self._writer.flush()

    def finalize(self, status: str) -> None:
        """Upload the checkpoints, end the backend's run with `status`, stop the worker.

        On `"failed"` a write error is printed rather than raised: the run's own error comes first.
        """
        directory = self.checkpoint_dir
        if directory is None and self.run_dir is not None:
            directory = self.run_dir / CHECKPOINTS
        files = checkpoints_to_upload(directory, self.log_checkpoints) if directory is not None else []
        failed = status != "success"
        try:
            self._writer.submit(("end", status, files))
        except Exception:
            if not failed:
                raise
        self._writer.close(raise_errors=not failed)

    @property
    def pending(self) -> int:
        """Items logged but not yet sent."""
        return self._writer.pending

    # --- the worker thread --------------------------------------------------------------------------
    def write(self, items: list[Any]) -> None:
        """Send `items` (see the module's docstring) to the backend. Runs on the worker thread."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement write(items)")

"""The `Logger` interface every metric backend implements."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dream_trainer.errors import LoggerWriteError
from dream_trainer.utils.replace_file import is_no_space, no_space_hint


@contextlib.contextmanager
def writing_to(logger: Logger) -> Iterator[None]:
    """Around a call into `logger`: a failed write (`OSError`: a full disk, a folder made read-only)
    becomes a `LoggerWriteError` whose first line names the logger, the file and the free space."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, LoggerWriteError):
            raise
        raise logger_write_failure(logger, exc) from exc


def logger_write_failure(logger: Logger, exc: OSError) -> LoggerWriteError:
    """The error for `logger` failing to write with `exc` (the file from the error, else its folder)."""
    name = type(logger).__name__
    where = Path(exc.filename) if exc.filename else logger.log_dir  # the file loggers name theirs (`naming`)
    target = f"{str(where)!r}" if where is not None else "its files"
    if is_no_space(exc):
        hint = f"{no_space_hint(where or Path('.'))}; free some space"
    else:
        hint = f"{exc.strerror or exc}; make that folder writable (or choose another root_dir)"
    message = f"{name} cannot write {target}: {hint}, then resume with fit(ckpt_path='last')"  # the OSError: its cause
    return LoggerWriteError(exc.errno if exc.errno is not None else errno.EIO, message)


class Logger:
    """Receives reduced metrics (plain floats). Only global rank zero calls a logger.

    Subclass and override `log_metrics`; the other methods are optional. Loggers that write files
    put them in the run's log directory, which the trainer hands over through `attach` (a logger
    built with its own `save_dir` keeps it).
    """

    log_dir: Path | None = None

    def attach(self, log_dir: Path) -> None:
        """Called at the start of `fit()` with the run's log directory (`trainer.log_dir`)."""
        if self.log_dir is None:
            self.log_dir = Path(log_dir)

    def resume(self, step: int) -> None:
        """Called after `attach`, before `log_hyperparams`, when `fit()` continues this run from its
        checkpoint at training step `step` (global rank zero only).

        The process that wrote that checkpoint may have logged later steps before it stopped; the
        resumed run trains and logs them again. A logger that keeps history across processes (files,
        a tracker's run) continues it here so that every step is in it once: see
        `dream_trainer.loggers.resume`. A new run (also one started from another run's checkpoint)
        never calls it.
        """

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration once, at the start of `fit()`."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record `metrics` at training step `step`."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement log_metrics(metrics, step)")

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        """Record images: uint8 `(N, H, W, C)` on the CPU. Backends without images ignore them."""

    def log_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        """Record the distribution of `values` (a CPU tensor). Backends without histograms ignore it."""

    def flush(self) -> None:
        """Write what is buffered; `save_checkpoint` calls it before writing, so a run resumed from
        that checkpoint has every value logged before it."""

    def finalize(self, status: str) -> None:
        """Flush and close at the end of `fit()`; `status` is "success" or "failed"."""


class MemoryLogger(Logger):
    """Keeps every logged metric in memory: `history` is a list of `(step, {name: value})`.

    Useful in tests and notebooks, and as the smallest example of a logger.
    """

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []
        self.hyperparams: dict[str, Any] = {}
        self.images: list[tuple[str, int, torch.Tensor]] = []
        self.status: str | None = None

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.hyperparams = dict(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        self.images.append((tag, step, images))

    def finalize(self, status: str) -> None:
        self.status = status

    def series(self, name: str) -> list[tuple[int, float]]:
        """Every `(step, value)` logged for `name`, in order."""
        return [(s, m[name]) for s, m in self.history if name in m]

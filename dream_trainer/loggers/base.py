"""The `Logger` interface every metric backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Logger:
    """Receives reduced metrics (plain floats). Only global rank zero calls a logger.

    Subclass and override `log_metrics`; `log_hyperparams` and `finalize` are optional.
    """

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration once, at the start of `fit()`."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record `metrics` at training step `step`."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement log_metrics(metrics, step)")

    def finalize(self, status: str) -> None:
        """Flush and close at the end of `fit()`; `status` is "success" or "failed"."""


class MemoryLogger(Logger):
    """Keeps every logged metric in memory: `history` is a list of `(step, {name: value})`.

    Useful in tests and notebooks, and as the smallest example of a logger.
    """

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []
        self.hyperparams: dict[str, Any] = {}
        self.status: str | None = None

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.hyperparams = dict(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.history.append((step, dict(metrics)))

    def finalize(self, status: str) -> None:
        self.status = status

    def series(self, name: str) -> list[tuple[int, float]]:
        """Every `(step, value)` logged for `name`, in order."""
        return [(s, m[name]) for s, m in self.history if name in m]

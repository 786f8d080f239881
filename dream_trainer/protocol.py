"""`TrainerProtocol`: what any trainer offers (seed 003), for code that works with trainers in general."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainerProtocol(Protocol):
    """The contract every trainer meets; `DreamTrainer` and its subclasses implement it.

    Write tools (launchers, sweeps, evaluation harnesses) against this protocol rather than a concrete
    class; `isinstance(obj, TrainerProtocol)` checks the methods are there.
    """

    global_step: int
    current_epoch: int

    def fit(self, ckpt_path: str | os.PathLike[str] | None = None) -> None:
        """Train (optionally resuming from a checkpoint)."""

    def validate(
        self, dataloader: Iterable[Any] | None = None, ckpt_path: str | os.PathLike[str] | None = None
    ) -> dict[str, float]:
        """Run validation alone and return its metrics."""

    def test(
        self, dataloader: Iterable[Any] | None = None, ckpt_path: str | os.PathLike[str] | None = None
    ) -> dict[str, float]:
        """Run the test loop and return its metrics."""

    def predict(
        self, dataloader: Iterable[Any] | None = None, ckpt_path: str | os.PathLike[str] | None = None
    ) -> list[Any]:
        """Return predictions for every batch."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training."""

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore `state_dict()`'s result."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Any:
        """Write a checkpoint file."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Any:
        """Read a checkpoint file and restore it."""

"""`TrainerProtocol`: the public surface of a trainer.

What a callback, a logger or a tool (launcher, sweep, evaluation harness) may use is what this
protocol lists; the built-in callbacks are typed against it, so a type checker proves they need
nothing private. `DreamTrainer` and its subclasses implement it; `isinstance(obj, TrainerProtocol)`
checks the members are there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim import Optimizer

    from dream_trainer.config import DreamTrainerConfig
    from dream_trainer.loggers.base import Logger
    from dream_trainer.loop_state import LoopState


@runtime_checkable
class TrainerProtocol(Protocol):
    """The contract every trainer meets.

    Position: `loop` (a `LoopState`: `loop.step_ended`, `loop.is_logging_step`, window and epoch
    position), `global_step`, `current_epoch`, `is_optimizer_step_end`, `should_stop` (set it to end training),
    `sanity_checking`. Results: `callback_metrics`, `progress_bar_metrics`. Identity: `config`, `device`, `world_size`,
    `global_rank`, `is_global_zero`, `is_distributed`. Files: `run_dir`, `log_dir`, `loggers`.
    """

    # --- position and control -----------------------------------------------------------------------
    config: DreamTrainerConfig
    should_stop: bool
    sanity_checking: bool
    callbacks: list[Any]

    @property
    def loop(self) -> LoopState:
        """Where the training loop is (read-only)."""

    @property
    def global_step(self) -> int:
        """Completed training steps (accumulation windows)."""

    @property
    def is_optimizer_step_end(self) -> bool:
        """In `on_train_batch_end`: True when this micro-batch completed an accumulation window (a
        training step), False for the other micro-batches of the window and outside training."""

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (0-based)."""

    @property
    def num_training_batches(self) -> int | None:
        """Batches in one training epoch after `limit_train_batches` (None: no length)."""

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest value of every logged metric, as floats."""

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The metrics a progress display shows (`self.log(..., prog_bar=True)`, else all)."""

    @property
    def validation_metrics(self) -> dict[str, float]:
        """The results of the last validation (not the sanity check); empty before the first one."""

    # --- identity -----------------------------------------------------------------------------------
    device: torch.device
    world_size: int
    global_rank: int

    @property
    def is_global_zero(self) -> bool:
        """True on the process that writes logs, progress and checkpoints."""

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in training."""

    @property
    def is_setup(self) -> bool:
        """True once the setup phase of `fit()` has run."""

    # --- what the user assigned ---------------------------------------------------------------------
    def named_models(self) -> list[tuple[str, nn.Module]]:
        """`(attribute name, module)` for every model."""

    def named_optimizers(self) -> list[tuple[str, Optimizer]]:
        """`(attribute name, optimizer)` for every optimizer."""

    def named_schedulers(self) -> list[tuple[str, Any]]:
        """`(attribute name, scheduler)` for every LR scheduler."""

    def optimizer_name(self, optimizer: Optimizer) -> str:
        """The attribute name `optimizer` was assigned to."""

    def scheduler_interval(self, scheduler: Any) -> str:
        """`"step"` or `"epoch"`: when `scheduler` steps (its own interval, else the config's)."""

    @property
    def val_loader(self) -> Iterable[Any] | None:
        """The validation loader (None when there is none)."""

    current_batch_indices: list[int] | None
    """The dataset indices of the batch `predict()` is at (a plain `DataLoader` over a map-style
    dataset); None otherwise. What a prediction writer saves beside the predictions."""

    # --- logging ------------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        """Where this run's files go."""

    @property
    def log_dir(self) -> Path:
        """This run's log directory, shared by every logger and by callbacks that write files."""

    @property
    def loggers(self) -> list[Logger]:
        """The run's loggers."""

    def log(self, name: str, value: torch.Tensor | float, *, batch_size: int | None = None) -> None:
        """Record a value to be aggregated and logged at the next logging point."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Send `metrics` to the loggers as they are."""

    def log_images(self, tag: str, images: torch.Tensor, step: int | None = None) -> None:
        """Send a batch of images to the loggers that take images."""

    # --- collectives --------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across processes in place and return it."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` as held by rank `src`."""

    def barrier(self) -> None:
        """Wait for every process."""

    # --- running ------------------------------------------------------------------------------------
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

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training."""

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore `state_dict()`'s result."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Any:
        """Write a checkpoint."""

    def snapshot(self) -> Any:
        """The whole run state now, in memory (a `RunSnapshot`: weights, optimizers, schedulers, scaler,
        loop counters, RNG, metrics, callbacks' state); `restore(snapshot)` puts it back."""

    def restore(self, snapshot: Any) -> None:
        """Put back what `snapshot()` returned (any number of times); the data iterator is not rewound."""

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Any:
        """Read a checkpoint and restore it."""

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints of this run go."""

    @property
    def sharded_checkpoints(self) -> bool:
        """True when checkpoints are sharded directories rather than files."""

    def after_checkpoint_write(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` once the checkpoint being written is on disk."""

    def at_batch_boundary(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` once the running training batch has ended: after every `on_train_batch_end`
        and the validation its step runs, before the next batch (now, when no batch is ending)."""

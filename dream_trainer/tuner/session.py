"""A tuning session: training steps run through the trainer's own step, then everything put back.

The tuners (`lr_find`, `scale_batch_size`) call `trainer.training_step`, the full step of `fit()`, so
accumulation, mixed precision, clipping and the non-finite policies are the trainer's own. While a
session lasts, nothing leaves the trainer: callbacks do not fire (the trainer's own hooks still do),
loggers get nothing, no metrics are reduced, no run directory is claimed, and per-step schedulers are
held still (the tuner sets the learning rate): the trainer's `tuning_run()`. When it ends,
`TrainerSnapshot.restore()` puts back the trainer's own snapshot (`trainer.snapshot()` /
`trainer.restore()`: weights, gradients, optimizer and scheduler state, and the registry of
`dream_trainer.run_state`: the loop, the loss scaler, the RNG, accumulated metrics, ...), so `fit()`
afterwards is the run it would have been.

The snapshot lives in memory (a copy of the weights and optimizer state), not in a file. The tuner uses
the trainer's public API only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dream_trainer.errors import MisconfigurationError
from dream_trainer.trainer import DreamTrainer
from dream_trainer.utils.step_outputs import loss_of


class TrainerSnapshot:
    """The trainer's own snapshot (`trainer.snapshot()`, `dream_trainer.snapshot`), taken once;
    `restore()` puts it back, any number of times (the batch-size finder starts every trial from it)."""

    def __init__(self, trainer: DreamTrainer) -> None:
        self.trainer = trainer
        self._saved = trainer.snapshot()

    def restore(self) -> None:
        """Put everything captured back (copies: the snapshot stays valid for the next restore)."""
        self.trainer.restore(self._saved)


@contextlib.contextmanager
def tuning_session(trainer: DreamTrainer, tool: str) -> Iterator[TrainerSnapshot]:
    """Set the trainer up and isolate it (`trainer.tuning_run`, see the module docstring), and snapshot
    it; on exit, however it exits, restore the snapshot and undo the isolation. `tool` names the caller
    in errors."""
    if not isinstance(trainer, DreamTrainer):
        raise TypeError(f"{tool} needs a DreamTrainer; got {type(trainer).__name__}")
    with trainer.tuning_run(tool):
        snapshot = TrainerSnapshot(trainer)
        for _, model in trainer.named_models():
            model.train()
        try:
            yield snapshot
        finally:
            snapshot.restore()


def cycle_batches(trainer: DreamTrainer) -> Iterator[tuple[int, Any]]:
    """`(batch_idx, batch)` of the training loader, `limit_train_batches` applied, starting over at
    the end of each pass (a short loader still gives a tuner as many steps as it asks for)."""
    loader = trainer.train_loader.loader  # set up by tuning_run
    length = trainer.loop.epoch_length
    while True:
        produced = False
        for batch_idx, batch in enumerate(loader):
            if length is not None and batch_idx >= length:
                break
            produced = True
            yield batch_idx, batch
        if not produced:
            raise MisconfigurationError("the training loader yielded no batch: the tuner has nothing to train on")


def required_loss(outputs: Any, tool: str, trainer: DreamTrainer) -> torch.Tensor:
    """The loss `training_step` returned (`loss_of`), detached; an error naming what to return when there is
    none (a finder reads it)."""
    loss = loss_of(outputs)
    if loss is not None and loss.numel() == 1:
        return loss.detach()
    raise MisconfigurationError(
        f"{tool} reads the loss from what {type(trainer).__name__}.training_step returns, and it returned "
        f"{type(outputs).__name__}: return the loss (a scalar tensor, or a dict with it under 'loss'), also when "
        "the step calls self.backward itself"
    )

"""HooksMixin: the trainer's own hooks, no-ops to override.

They take the callback hooks' arguments minus `trainer` (the trainer is `self`) and fire after the
callbacks' hooks. Only the hooks a subclass overrides are dispatched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer


class HooksMixin:
    """No-op hook methods; override any of them on your trainer."""

    def setup(self, stage: str) -> None:
        """Before `configure_models`."""

    def on_fit_start(self) -> None:
        """After setup, before the sanity check."""

    def on_sanity_check_start(self) -> None:
        """Before the sanity validation."""

    def on_sanity_check_end(self) -> None:
        """After the sanity validation."""

    def on_train_start(self) -> None:
        """Before the first epoch."""

    def on_train_epoch_start(self) -> None:
        """At the start of each epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each `training_step`."""

    def on_before_zero_grad(self, optimizer: Optimizer) -> None:
        """Before an optimizer's gradients are zeroed."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Before `backward`."""

    def on_after_backward(self) -> None:
        """After `backward`."""

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Before `optimizer.step()` (gradients unscaled and clipped)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each `training_step` and the steps it caused."""

    def on_validation_start(self) -> None:
        """At the start of a validation run."""

    def on_validation_epoch_start(self) -> None:
        """After `on_validation_start`."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each `validation_step`."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each `validation_step`."""

    def on_validation_epoch_end(self) -> None:
        """After the last validation batch (log epoch-level values here)."""

    def on_validation_end(self) -> None:
        """At the end of a validation run; `callback_metrics` holds its results."""

    def on_train_epoch_end(self) -> None:
        """At the end of each epoch, after its validation."""

    def on_train_end(self) -> None:
        """After the last epoch."""

    def on_fit_end(self) -> None:
        """At the end of a successful `fit()`."""

    def on_test_start(self) -> None:
        """At the start of a test run (`trainer.test()`)."""

    def on_test_epoch_start(self) -> None:
        """After `on_test_start`."""

    def on_test_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each `test_step`."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each `test_step`."""

    def on_test_epoch_end(self) -> None:
        """After the last batch of a test run (`trainer.test()`)."""

    def on_test_end(self) -> None:
        """At the end of a test run (`trainer.test()`)."""

    def on_predict_start(self) -> None:
        """At the start of a prediction run (`trainer.predict()`)."""

    def on_predict_epoch_start(self) -> None:
        """After `on_predict_start`."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each `predict_step`."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each `predict_step`."""

    def on_predict_epoch_end(self) -> None:
        """After the last batch of a prediction run (`trainer.predict()`)."""

    def on_predict_end(self) -> None:
        """At the end of a prediction run (`trainer.predict()`)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is built; may add entries."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is restored."""

    def on_exception(self, exception: BaseException) -> None:
        """When `fit()` fails."""

    def teardown(self, stage: str) -> None:
        """Always last."""

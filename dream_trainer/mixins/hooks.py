"""HooksMixin: the trainer's own hooks, no-ops to override.

They take the callback hooks' arguments minus `trainer` (the trainer is `self`) and fire after the
callbacks' hooks. Only the hooks a subclass overrides are dispatched. The hooks are declared by
`Callback`'s methods (`dream_trainer/callbacks/base.py`); `@hook_defaults` checks the methods below
against them at import (same names, order, arguments, return annotations and summary lines).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import HOOK_SPECS
from dream_trainer.hook_spec import hook_defaults

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer


@hook_defaults(HOOK_SPECS, "trainer")
class HooksMixin:
    """No-op hook methods; override any of them on your trainer."""

    def setup(self, stage: str) -> None:
        """Before `configure_models`, once the process group and device are known; `stage` is "fit"."""

    def on_fit_start(self) -> None:
        """After setup (and resume), before the sanity check."""

    def on_sanity_check_start(self) -> None:
        """Before the sanity validation (only when it runs)."""

    def on_sanity_check_end(self) -> None:
        """After the sanity validation (only when it runs)."""

    def on_train_start(self) -> None:
        """Before the first training epoch."""

    def on_train_epoch_start(self) -> None:
        """At the start of each training epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Before `training_step`; `batch` is on the device; return -1 to skip the rest of the epoch.

        As in Lightning: -1 skips this batch and the epoch's remaining ones (a window already begun is
        stepped at the epoch's end, as when a loader without a length runs out)."""
        return None

    def on_before_zero_grad(self, optimizer: Optimizer) -> None:
        """Before an optimizer's gradients are zeroed (the start of each accumulation window)."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Before `backward`, with the loss as `training_step` computed it (unscaled)."""

    def on_after_backward(self) -> None:
        """After `backward`, gradients populated (still scaled when fp16 is on)."""

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Before `optimizer.step()`; gradients are unscaled and clipped."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `training_step` and any optimizer steps it caused; `outputs` is what it returned."""

    def on_validation_start(self) -> None:
        """At the start of a validation run (also during the sanity check)."""

    def on_validation_epoch_start(self) -> None:
        """After `on_validation_start`, models in eval mode."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before `validation_step`."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `validation_step`; `outputs` is what it returned."""

    def on_validation_epoch_end(self) -> None:
        """After the last validation batch; values logged here join this run's results.

        They reach `self.callback_metrics` just after: read them in `on_validation_end`.
        """

    def on_validation_end(self) -> None:
        """At the end of a validation run, models back in their previous mode."""

    def on_train_epoch_end(self) -> None:
        """At the end of each training epoch, after that epoch's validation."""

    def on_train_end(self) -> None:
        """After the last training epoch."""

    def on_fit_end(self) -> None:
        """At the very end of a successful `fit()`."""

    def on_test_start(self) -> None:
        """At the start of a test run (`trainer.test()`)."""

    def on_test_epoch_start(self) -> None:
        """After `on_test_start`, models in eval mode."""

    def on_test_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before `test_step`."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `test_step`; `outputs` is what it returned."""

    def on_test_epoch_end(self) -> None:
        """After the last batch of a test run (`trainer.test()`)."""

    def on_test_end(self) -> None:
        """At the end of a test run (`trainer.test()`)."""

    def on_predict_start(self) -> None:
        """At the start of a prediction run (`trainer.predict()`)."""

    def on_predict_epoch_start(self) -> None:
        """After `on_predict_start`, models in eval mode."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before `predict_step`."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `predict_step`; `outputs` is what it returned."""

    def on_predict_epoch_end(self) -> None:
        """After the last batch of a prediction run (`trainer.predict()`)."""

    def on_predict_end(self) -> None:
        """At the end of a prediction run (`trainer.predict()`)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When `trainer.state_dict()` builds a checkpoint; may add entries to `checkpoint`."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When `trainer.load_state_dict()` restores a checkpoint, before the trainer reads it."""

    def on_exception(self, exception: BaseException) -> None:
        """When `fit()` fails; `teardown` runs after it and the exception then propagates unchanged."""

    def teardown(self, stage: str) -> None:
        """Always last, also after an exception."""

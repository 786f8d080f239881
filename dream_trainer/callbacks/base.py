"""The `Callback` base class: Lightning's hook names, with the trainer as the first argument.

`Callback` is where the hooks are declared: each no-op method named like a hook (`on_*`, `setup`,
`teardown`) is one, with its arguments, its return annotation and the first paragraph of its docstring,
in the order written, which is the firing order. `HOOK_SPECS` and `HOOKS`, below the class, are read
from it (`dream_trainer.hook_spec.declare_hooks`); `HooksMixin` and the bus are built or checked from
them. To add a hook, see `dream_trainer.hook_spec`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dream_trainer.hook_spec import HookSpec, declare_hooks

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer

    from dream_trainer.protocol import TrainerProtocol

__all__ = ["HOOKS", "HOOK_SPECS", "Callback"]


class Callback:
    """Base class for callbacks. Override only the hooks you need: the others cost nothing.

    The bus calls a callback's hook only if its class overrides it, so an empty base method is never
    dispatched. Stateful callbacks return their state from `state_dict()`; it is saved in checkpoints
    under `state_key` and handed back to `load_state_dict()` on resume.
    """

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint. Override when one run holds two of a kind."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (tensors, numbers, strings, lists and dicts of those)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state `state_dict()` returned."""

    def setup(self, trainer: TrainerProtocol, stage: str) -> None:
        """Before `configure_models`, once the process group and device are known; `stage` is "fit"."""

    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        """After setup (and resume), before the sanity check."""

    def on_sanity_check_start(self, trainer: TrainerProtocol) -> None:
        """Before the sanity validation (only when it runs)."""

    def on_sanity_check_end(self, trainer: TrainerProtocol) -> None:
        """After the sanity validation (only when it runs)."""

    def on_train_start(self, trainer: TrainerProtocol) -> None:
        """Before the first training epoch."""

    def on_train_epoch_start(self, trainer: TrainerProtocol) -> None:
        """At the start of each training epoch."""

    def on_train_batch_start(self, trainer: TrainerProtocol, batch: Any, batch_idx: int) -> int | None:
        """Before `training_step`; `batch` is on the device; return -1 to skip the rest of the epoch.

        As in Lightning: -1 skips this batch and the epoch's remaining ones (a window already begun is
        stepped at the epoch's end, as when a loader without a length runs out)."""
        return None

    def on_before_zero_grad(self, trainer: TrainerProtocol, optimizer: Optimizer) -> None:
        """Before an optimizer's gradients are zeroed (the start of each accumulation window)."""

    def on_before_backward(self, trainer: TrainerProtocol, loss: torch.Tensor) -> None:
        """Before `backward`, with the loss as `training_step` computed it (unscaled)."""

    def on_after_backward(self, trainer: TrainerProtocol) -> None:
        """After `backward`, gradients populated (still scaled when fp16 is on)."""

    def on_before_optimizer_step(self, trainer: TrainerProtocol, optimizer: Optimizer) -> None:
        """Before `optimizer.step()`; gradients are unscaled and clipped."""

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `training_step` and any optimizer steps it caused; `outputs` is what it returned."""

    def on_validation_start(self, trainer: TrainerProtocol) -> None:
        """At the start of a validation run (also during the sanity check)."""

    def on_validation_epoch_start(self, trainer: TrainerProtocol) -> None:
        """After `on_validation_start`, models in eval mode."""

    def on_validation_batch_start(self, trainer: TrainerProtocol, batch: Any, batch_idx: int) -> None:
        """Before `validation_step`."""

    def on_validation_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `validation_step`; `outputs` is what it returned."""

    def on_validation_epoch_end(self, trainer: TrainerProtocol) -> None:
        """After the last validation batch; values logged here join this run's results.

        They reach `trainer.callback_metrics` just after: read them in `on_validation_end`.
        """

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        """At the end of a validation run, models back in their previous mode."""

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        """At the end of each training epoch, after that epoch's validation."""

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        """After the last training epoch."""

    def on_fit_end(self, trainer: TrainerProtocol) -> None:
        """At the very end of a successful `fit()`."""

    def on_test_start(self, trainer: TrainerProtocol) -> None:
        """At the start of a test run (`trainer.test()`)."""

    def on_test_epoch_start(self, trainer: TrainerProtocol) -> None:
        """After `on_test_start`, models in eval mode."""

    def on_test_batch_start(self, trainer: TrainerProtocol, batch: Any, batch_idx: int) -> None:
        """Before `test_step`."""

    def on_test_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `test_step`; `outputs` is what it returned."""

    def on_test_epoch_end(self, trainer: TrainerProtocol) -> None:
        """After the last batch of a test run (`trainer.test()`)."""

    def on_test_end(self, trainer: TrainerProtocol) -> None:
        """At the end of a test run (`trainer.test()`)."""

    def on_predict_start(self, trainer: TrainerProtocol) -> None:
        """At the start of a prediction run (`trainer.predict()`)."""

    def on_predict_epoch_start(self, trainer: TrainerProtocol) -> None:
        """After `on_predict_start`, models in eval mode."""

    def on_predict_batch_start(self, trainer: TrainerProtocol, batch: Any, batch_idx: int) -> None:
        """Before `predict_step`."""

    def on_predict_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `predict_step`; `outputs` is what it returned."""

    def on_predict_epoch_end(self, trainer: TrainerProtocol) -> None:
        """After the last batch of a prediction run (`trainer.predict()`)."""

    def on_predict_end(self, trainer: TrainerProtocol) -> None:
        """At the end of a prediction run (`trainer.predict()`)."""

    def on_save_checkpoint(self, trainer: TrainerProtocol, checkpoint: dict[str, Any]) -> None:
        """When `trainer.state_dict()` builds a checkpoint; may add entries to `checkpoint`."""

    def on_load_checkpoint(self, trainer: TrainerProtocol, checkpoint: dict[str, Any]) -> None:
        """When `trainer.load_state_dict()` restores a checkpoint, before the trainer reads it."""

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        """When `fit()` fails; `teardown` runs after it and the exception then propagates unchanged."""

    def teardown(self, trainer: TrainerProtocol, stage: str) -> None:
        """Always last, also after an exception."""


HOOK_SPECS: tuple[HookSpec, ...] = declare_hooks(Callback)
"""Every hook `Callback` declares (name, arguments after `trainer`, summary line, return annotation),
in firing order."""

HOOKS: tuple[str, ...] = tuple(spec.name for spec in HOOK_SPECS)
"""Every hook's name, in firing order."""

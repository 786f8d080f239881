"""StepMixin: the full training step that every call of `self.training_step` goes through.

At setup the trainer puts `_full_training_step` on the instance as `training_step`, so the default
loop and a user's own `training_loop()` get the same step: batch on the device, accumulation window,
autocast, automatic backward/step, hooks, counters and metric aggregation.

It sits above everything a step touches (the window and backward of `OptimizationMixin`, the metrics
of `LoggingMixin`, both under `SetupMixin`, and the signal check of `SignalMixin`) and implements
`SetupMixin`'s template `_install_step_wrappers`; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.mixins.optimization import _RetryBatch
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.signals import SignalMixin
from dream_trainer.utils.tensors import move_to_device


def _loss_of(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


_ACCEPTED = (
    "accepted: a scalar loss tensor (the trainer calls self.backward on it); a dict with a scalar loss "
    'tensor under "loss" (its other scalar entries are logged); or, after calling self.backward(loss) in '
    "the step, None or a dict of metrics"
)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        grad = "" if value.requires_grad else ", requires_grad=False"
        return f"a tensor of shape {tuple(value.shape)} (dtype {value.dtype}{grad})"
    text = repr(value)
    return f"a {type(value).__qualname__} ({text if len(text) <= 60 else text[:57] + '...'})"


def step_output_problem(outputs: Any, backward_called: bool) -> str | None:
    """What is wrong with `outputs` as the return value of a `training_step` (None: nothing).
    `backward_called`: the step called `self.backward` (or stepped an optimizer) itself."""
    if isinstance(outputs, torch.Tensor):
        loss = outputs
    elif isinstance(outputs, Mapping):
        if "loss" not in outputs:
            if backward_called:
                return None
            return (
                f'a dict without a "loss" entry (keys {sorted(map(str, outputs))}) and did not call '
                "self.backward(loss): nothing would be backpropagated"
            )
        loss = outputs["loss"]
        if not isinstance(loss, torch.Tensor):
            if backward_called and isinstance(loss, (int, float)) and not isinstance(loss, bool):
                return None  # a number logged as "loss" after backpropagating it
            return f'a dict whose "loss" is {_describe(loss)}, not a scalar tensor'
        if loss.numel() != 1:
            return f'a dict whose "loss" is {_describe(loss)}, not a scalar (reduce it, e.g. .mean())'
    elif outputs is None:
        return None if backward_called else "None without calling self.backward(loss): nothing was backpropagated"
    else:
        return _describe(outputs)
    if loss.numel() != 1:
        return f"{_describe(loss)}, not a scalar (reduce it, e.g. .mean())"
    if not backward_called and not loss.requires_grad:
        return (
            f"a loss that does not require grad ({_describe(loss)}): it was computed under torch.no_grad() "
            "or detached, so it cannot be backpropagated"
        )
    return None


class StepMixin(SetupMixin, SignalMixin):
    """The per-batch machinery around the user's `training_step` and `validation_step`.

    The first step of every `fit()` checks what the user's `training_step` returned (see
    `_checked_call_user_step`); later steps run without the check, at no cost.
    """

    def _install_step_wrappers(
        self, user_training_step: Callable[..., Any], user_validation_step: Callable[..., Any] | None
    ) -> None:
        self._user_training_step: Callable[..., Any] = user_training_step
        self._move_batches: bool = self.device.type != "cpu"  # CPU batches are already where they belong
        self._non_blocking: bool = self.device.type == "cuda"
        self._retry: bool = self.config.non_finite_grads == "retry"
        self._max_retries: int = self.config.max_non_finite_retries
        # The instance attribute shadows the user's method: every caller gets the full step.
        self.training_step = self._full_training_step  # type: ignore[method-assign]  # on purpose, see above
        self._arm_step_output_check()
        if user_validation_step is not None:
            self._user_validation_step: Callable[..., Any] = user_validation_step
            self.validation_step = self._full_validation_step  # type: ignore[method-assign]  # likewise

    # --- training ---------------------------------------------------------------------------------
    def _full_training_step(self, batch: Any, batch_idx: int) -> Any:
        if self._move_batches:
            batch = move_to_device(batch, self.device, self._non_blocking)
        bus, loop = self._bus, self._loop
        for fn in bus.on_train_batch_start:
            fn(batch, batch_idx)
        if loop.window_pos == 0:
            self._begin_window(batch_idx, loop.epoch_length)
        loop.window_pos += 1
        loop.window_end = loop.window_pos >= loop.window_size
        outputs = self._step_with_retries(batch, batch_idx) if self._retry else self._step_body(batch, batch_idx)
        if isinstance(outputs, torch.Tensor):
            if outputs.numel() == 1:
                self._train_metrics.add("loss", outputs)
        elif type(outputs) is dict or isinstance(outputs, Mapping):  # plain dicts skip the ABC check
            self._train_metrics.update(outputs)
        if loop.window_end:
            self._end_window()
            if loop.global_step % loop.log_every_n_steps == 0:
                self._flush_train_metrics()
        loop.batches_done += 1  # a checkpoint written from on_train_batch_end resumes after this batch
        for fn in bus.on_train_batch_end:
            fn(outputs, batch, batch_idx)
        if self._signal_received is not None or self._agree_on_signals:
            self._check_signal()
        return outputs

    def _step_body(self, batch: Any, batch_idx: int) -> Any:
        self._backward_in_step = False
        window_end = self._loop.window_end
        if self._sync_models and not window_end:
            # Inside an accumulation window DDP must skip gradient sync, and it decides at forward
            # time: the whole step (forward and backward) runs under no_sync.
            with self._no_sync(self._sync_models):
                outputs = self._call_user_step(batch, batch_idx)
        else:
            outputs = self._call_user_step(batch, batch_idx)
        if not self._backward_in_step:
            loss = _loss_of(outputs)
            if loss is not None:
                self.backward(loss)
        if window_end:
            self._auto_step()
        return outputs

    def _call_user_step(self, batch: Any, batch_idx: int) -> Any:
        if self._amp_dtype is None:
            return self._user_training_step(batch, batch_idx)
        with torch.autocast(self.device.type, dtype=self._amp_dtype):
            return self._user_training_step(batch, batch_idx)

    # --- the first step's output check ------------------------------------------------------------
    def _arm_step_output_check(self) -> None:
        """Check the next step's output (at setup, and at the start of every `fit()`).

        An instance attribute shadows `_call_user_step` for one call: the checking version removes
        itself, so from the second step on `_step_body` finds the plain method, exactly as before.
        """
        self.__dict__["_call_user_step"] = self._checked_call_user_step

    def _checked_call_user_step(self, batch: Any, batch_idx: int) -> Any:
        self.__dict__.pop("_call_user_step", None)
        outputs = type(self)._call_user_step(self, batch, batch_idx)
        problem = step_output_problem(outputs, self._backward_in_step or self._manual_step)
        if problem is not None:
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step returned {problem}; {_ACCEPTED}. "
                "(Checked on the first step of each fit().)"
            )
        return outputs

    def _step_with_retries(self, batch: Any, batch_idx: int) -> Any:
        attempts = 0
        while True:
            try:
                return self._step_body(batch, batch_idx)
            except _RetryBatch as retry:
                attempts += 1
                if attempts > self._max_retries:
                    raise NonFiniteGradientError(
                        f"non-finite gradients for optimizer {retry.args[0]!r} at global_step {self._loop.global_step} "
                        f"persisted through {self._max_retries} retries (config.max_non_finite_retries). "
                        "Lower the learning rate, clip gradients, or use non_finite_grads='skip'."
                    ) from None
                self.non_finite_counts["retried"] += 1
                self._reset_window_for_retry()

    # --- validation -------------------------------------------------------------------------------
    def _full_validation_step(self, batch: Any, batch_idx: int, *dataloader_idx: int) -> Any:
        # `dataloader_idx` is passed only with several validation loaders, to a step that takes it.
        if self._move_batches:
            batch = move_to_device(batch, self.device, self._non_blocking)
        if self._amp_dtype is None:
            return self._user_validation_step(batch, batch_idx, *dataloader_idx)
        with torch.autocast(self.device.type, dtype=self._amp_dtype):
            return self._user_validation_step(batch, batch_idx, *dataloader_idx)

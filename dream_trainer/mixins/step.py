"""StepMixin: the full training step that every call of `self.training_step` goes through.

At setup the trainer puts `_full_training_step` on the instance as `training_step`, so the default
loop and a user's own `training_loop()` get the same step: batch on the device, accumulation window,
autocast, automatic backward/step, hooks, counters and metric aggregation.

It sits above everything a step touches (the window and backward of `OptimizationMixin`, the metrics
of `LoggingMixin`, both under `SetupMixin`, and the signal check of `SignalMixin`) and implements
`SetupMixin`'s template `_install_step_wrappers`; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

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


def _positional_arity(fn: Callable[..., Any]) -> tuple[int, int | None]:
    """`(required, accepted)` positional arguments of a bound method; `accepted` None: any (`*args`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: call it as written
        return 0, None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return required, None
    return required, len(positional)


def _adapt_step(owner: str, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the loops call it, `(batch, batch_idx, *dataloader_idx)`: a step written without
    `batch_idx` (Lightning allows it) gets a wrapper that drops it; others are returned unchanged.
    Read once, at setup: the signature is never inspected per batch."""
    required, accepted = _positional_arity(fn)
    if accepted is not None and accepted < 1:
        raise MisconfigurationError(f"{owner}.{method} takes no batch: define `def {method}(self, batch, batch_idx):`.")
    if method == "training_step" and required > 2:
        raise MisconfigurationError(
            f"{owner}.training_step{inspect.signature(fn)} needs {required} arguments, but the trainer passes "
            "(batch, batch_idx): define `def training_step(self, batch, batch_idx):`. (Lightning 1.x's "
            "optimizer_idx is gone: call self.step(optimizer) for each optimizer inside the step.)"
        )
    if accepted != 1:
        return fn

    def without_batch_idx(batch: Any, batch_idx: int, *dataloader_idx: int) -> Any:
        return fn(batch)

    return without_batch_idx


_BYPASSED = (
    "the trainer's gradient accumulation (gradient_accumulation_steps), gradient clipping "
    "(gradient_clip_val, clip_gradients), fp16 loss scaling, the non-finite gradient policy, the "
    "on_before_backward/on_after_backward/on_before_optimizer_step hooks and per-step LR schedulers"
)
_WRITE_INSTEAD = (
    "return the loss (the trainer backpropagates and steps), or call self.backward(loss) and "
    "self.step(optimizer) (manual optimization; the trainer zeroes gradients): no loss.backward(), "
    "optimizer.step() or optimizer.zero_grad() of your own"
)


class StepMixin(SetupMixin, SignalMixin):
    """The per-batch machinery around the user's `training_step` and `validation_step`.

    The first step of every `fit()` checks what the user's `training_step` returned (see
    `_checked_call_user_step`); later steps run without the check, at no cost.
    """

    def _install_step_wrappers(
        self, user_training_step: Callable[..., Any], user_validation_step: Callable[..., Any] | None
    ) -> None:
        name = type(self).__name__
        self._user_training_step: Callable[..., Any] = _adapt_step(name, "training_step", user_training_step)
        self._max_steps_noted: bool = False  # the max_steps migration warning, once per trainer
        self._move_batches: bool = self.device.type != "cpu"  # CPU batches are already where they belong
        self._non_blocking: bool = self.device.type == "cuda"
        self._retry: bool = self.config.non_finite_grads == "retry"
        self._max_retries: int = self.config.max_non_finite_retries
        # The instance attribute shadows the user's method: every caller gets the full step.
        self.training_step = self._full_training_step  # type: ignore[method-assign]  # on purpose, see above
        self._arm_step_output_check()
        if user_validation_step is not None:
            self._user_validation_step: Callable[..., Any] = _adapt_step(name, "validation_step", user_validation_step)
            self.validation_step = self._full_validation_step  # type: ignore[method-assign]  # likewise
        # test()/predict() call `self.test_step`/`self.predict_step`: one written without batch_idx is
        # shadowed by its adapter here, once.
        for method in ("test_step", "predict_step"):
            own = getattr(type(self), method, None)
            if own is not None and method not in self.__dict__:
                bound = own.__get__(self)
                adapted = _adapt_step(name, method, bound)
                if adapted is not bound:
                    setattr(self, method, adapted)

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
        self._note_max_steps()
        # For this one call: count optimizer steps the trainer did not make (`optimizer.step()` written
        # in the step), by a post-step hook on each optimizer and a counting `_optimizer_step`.
        counts = {"all": 0, "trainer": 0}
        trainer_step = self._optimizer_step

        def counting_step(optimizer: Optimizer) -> torch.Tensor | None:
            counts["trainer"] += 1
            return trainer_step(optimizer)

        def on_step(*_: Any) -> None:
            counts["all"] += 1

        handles = [opt.register_step_post_hook(on_step) for opt in self._optimizer_list]
        self.__dict__["_optimizer_step"] = counting_step
        try:
            outputs = type(self)._call_user_step(self, batch, batch_idx)
        finally:
            self.__dict__.pop("_optimizer_step", None)
            for handle in handles:
                handle.remove()
        raw_step = counts["all"] > counts["trainer"]
        raw_backward = not self._backward_in_step and self._loop.window_pos == 1 and self._any_grad()
        if raw_step or raw_backward:
            self._bypass_problem(outputs, raw_step)
            return outputs
        problem = step_output_problem(outputs, self._backward_in_step or self._manual_step)
        if problem is not None:
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step returned {problem}; {_ACCEPTED}. "
                "(Checked on the first step of each fit().)"
            )
        return outputs

    def _any_grad(self) -> bool:
        # At a window's first batch every gradient was just set to None: one now came from the step.
        return any(p.grad is not None for o in self._optimizer_list for g in o.param_groups for p in g["params"])

    def _bypass_problem(self, outputs: Any, raw_step: bool) -> None:
        """The first step backpropagated or stepped an optimizer by itself (`loss.backward()`,
        `optimizer.step()`): an error where the trainer would then do it twice or never step, else
        one warning naming what the trainer no longer does."""
        name = type(self).__name__
        did = "called optimizer.step()" if raw_step else "called loss.backward() (gradients appeared)"
        if _loss_of(outputs) is not None and not self._backward_in_step:
            raise MisconfigurationError(
                f"{name}.training_step {did} itself and also returned the loss, which the trainer would "
                f"backpropagate a second time. Write instead: {_WRITE_INSTEAD}."
            )
        if raw_step and self._backward_in_step and not self._manual_step:
            raise MisconfigurationError(
                f"{name}.training_step called self.backward(loss) and then optimizer.step() itself: the "
                "trainer, seeing no self.step(...), would step every optimizer a second time. Call "
                "self.step(optimizer) instead of optimizer.step() (and drop optimizer.zero_grad())."
            )
        if not raw_step and not self._manual_step:
            raise MisconfigurationError(
                f"{name}.training_step called loss.backward() itself but stepped no optimizer and returned "
                f"no loss: nothing would ever update the weights. Write instead: {_WRITE_INSTEAD}."
            )
        if raw_step:
            bypassed, instead = _BYPASSED, _WRITE_INSTEAD
        else:  # loss.backward() with self.step(...): only the backward's share is bypassed
            bypassed = (
                "the accumulation window's loss averaging (gradient_accumulation_steps), fp16 loss scaling "
                "and the on_before_backward/on_after_backward hooks"
            )
            instead = "call self.backward(loss) instead of loss.backward()"
        warnings.warn(
            f"{name}.training_step {did} itself: training runs, but bypasses {bypassed}. "
            f"Write instead: {instead}. (Checked on the first step of each fit().)",
            UserWarning,
            stacklevel=2,
        )

    def _note_max_steps(self) -> None:
        """Once per trainer, at the first training step: with several optimizers, say that `max_steps`
        counts batches here, where Lightning counts optimizer steps (a migrated value trains twice as long)."""
        n, max_steps = len(self._optimizer_list), self.config.max_steps
        if self._max_steps_noted or n < 2 or max_steps is None:
            return
        self._max_steps_noted = True
        warnings.warn(
            f"max_steps={max_steps} counts training steps (batches), not optimizer steps as in Lightning: with "
            f"{n} optimizers Lightning's max_steps=N is max_steps=N/{n} here (when every batch steps each "
            f"optimizer). Keep {max_steps} if you meant {max_steps} batches.",
            UserWarning,
            stacklevel=3,
        )

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

"""StepMixin: the full training step that every call of `self.training_step` goes through.

At setup the trainer puts `_full_training_step` on the instance as `training_step`, so the default
loop and a user's own `training_loop()` get the same step: batch on the device, accumulation window,
autocast, automatic backward/step, hooks, counters and metric aggregation.

It sits above everything a step touches (the window and backward of `OptimizationMixin`, the metrics
of `LoggingMixin`, both under `SetupMixin`, and the signal check of `SignalMixin`) and implements
`SetupMixin`'s template `_install_step_wrappers`; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.mixins.core import lightning_names_explained
from dream_trainer.mixins.optimization import _RetryBatch
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.signals import SignalMixin
from dream_trainer.step_checks import (
    ACCEPTED_OUTPUTS,
    BYPASSED,
    WRITE_INSTEAD,
    GradientRouting,
    adapt_step,
    ends_epoch,
    loss_of,
    step_output_problem,
)
from dream_trainer.utils.tensors import move_to_device


class StepMixin(SetupMixin, SignalMixin):
    """The per-batch machinery around the user's `training_step` and `validation_step`.

    The first step of every `fit()` checks what the user's `training_step` returned (see
    `_checked_call_user_step`); later steps run without the check, at no cost.
    """

    def _install_step_wrappers(
        self, user_training_step: Callable[..., Any], user_validation_step: Callable[..., Any] | None
    ) -> None:
        name = type(self).__name__
        self._user_training_step: Callable[..., Any] = adapt_step(name, "training_step", user_training_step)
        self._max_steps_noted: bool = False  # the max_steps migration warning, once per trainer
        self._move_batches: bool = self.device.type != "cpu"  # CPU batches are already where they belong
        self._non_blocking: bool = self.device.type == "cuda"
        self._retry: bool = self.config.non_finite_grads == "retry"
        self._max_retries: int = self.config.max_non_finite_retries
        # The instance attribute shadows the user's method: every caller gets the full step.
        self.training_step = self._full_training_step  # type: ignore[method-assign]  # on purpose, see above
        self._arm_step_output_check()
        if user_validation_step is not None:
            self._user_validation_step: Callable[..., Any] = adapt_step(name, "validation_step", user_validation_step)
            self.validation_step = self._full_validation_step  # type: ignore[method-assign]  # likewise
        # test()/predict() call `self.test_step`/`self.predict_step`: one written without batch_idx is
        # shadowed by its adapter here, once.
        for method in ("test_step", "predict_step"):
            own = getattr(type(self), method, None)
            if own is not None and method not in self.__dict__:
                bound = own.__get__(self)
                adapted = adapt_step(name, method, bound)
                if adapted is not bound:
                    setattr(self, method, adapted)

    # --- training ---------------------------------------------------------------------------------
    def _full_training_step(self, batch: Any, batch_idx: int) -> Any:
        if self._move_batches:
            batch = move_to_device(batch, self.device, self._non_blocking)
        bus, loop = self._bus, self._loop
        for fn in bus.on_train_batch_start:
            if (said := fn(batch, batch_idx)) is not None and ends_epoch(said):
                loop.skip_rest_of_epoch = True  # Lightning's -1: this batch and the rest are skipped
                return None
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
            loss = loss_of(outputs)
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
        routing = self._watch_gradient_routing() if len(self._optimizer_list) > 1 else None
        zeroed = self._watch_zero_grad() if self._accumulation > 1 else None
        try:
            with lightning_names_explained(self):  # a ported `self.manual_backward(loss)`, ...
                outputs = type(self)._call_user_step(self, batch, batch_idx)
        finally:
            for name in ("_optimizer_step", "backward", "step"):
                self.__dict__.pop(name, None)
            for handle in handles:
                handle.remove()
            for opt in self._optimizer_list:
                if getattr(vars(opt).get("zero_grad"), "__name__", "") == "recording":
                    del opt.zero_grad  # the shadow `_watch_zero_grad` put there
        if zeroed:
            names = ", ".join(sorted({self.optimizer_name(o) for o in zeroed}))
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step calls zero_grad() on {names}, which erases the gradients "
                f"accumulated over the window (gradient_accumulation_steps={self._accumulation}): the trainer "
                "zeroes every optimizer at the start of each window, and self.step(optimizer) acts only at its "
                "end. Remove the zero_grad() call. (Checked on the first step of each fit().)"
            )
        if routing is not None:
            leaks = routing.leaks(window_continues=not self._loop.window_end)
            if leaks:
                warnings.warn(
                    f"{type(self).__name__}.training_step: " + "; ".join(leaks) + ". (Checked on the first step "
                    "of each fit().)",
                    UserWarning,
                    stacklevel=2,
                )
        raw_step = counts["all"] > counts["trainer"]
        raw_backward = not self._backward_in_step and self._loop.window_pos == 1 and self._any_grad()
        if raw_step or raw_backward:
            self._bypass_problem(outputs, raw_step)
            return outputs
        problem = step_output_problem(outputs, self._backward_in_step or self._manual_step)
        if problem is not None:
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step returned {problem}; {ACCEPTED_OUTPUTS}. "
                "(Checked on the first step of each fit().)"
            )
        return outputs

    def _watch_gradient_routing(self) -> GradientRouting:
        """Shadow `backward`/`step` on the instance for one call, recording into a `GradientRouting`
        what each unscoped backward reached and what was stepped after it (the caller removes them)."""
        routing = GradientRouting(self._optimizer_list, self.optimizer_name)
        backward, step = type(self).backward, type(self).step

        def watched_backward(loss: torch.Tensor, optimizer: Optimizer | None = None, **kwargs: Any) -> None:
            if optimizer is not None or "inputs" in kwargs:  # scoped: it reaches only what it names
                return backward(self, loss, optimizer, **kwargs)
            routing.before_backward()
            backward(self, loss, **kwargs)
            routing.after_backward()
            return None

        def watched_step(optimizer: Optimizer) -> torch.Tensor | None:
            routing.stepped(optimizer)
            return step(self, optimizer)

        self.__dict__["backward"] = watched_backward
        self.__dict__["step"] = watched_step
        return routing

    def _watch_zero_grad(self) -> list[Optimizer]:
        """Record, for one call, every `optimizer.zero_grad()` the step makes (an instance attribute
        shadows the method; the caller removes it). Lightning's manual-optimization code zeroes after
        each step, which here, inside an accumulation window, would erase the window's gradients."""
        zeroed: list[Optimizer] = []
        for opt in self._optimizer_list:
            if "zero_grad" in vars(opt):
                continue  # the user shadows it already: leave it alone

            def recording(*args: Any, _opt: Optimizer = opt, **kwargs: Any) -> None:
                zeroed.append(_opt)
                type(_opt).zero_grad(_opt, *args, **kwargs)

            opt.zero_grad = recording  # type: ignore[method-assign]  # one call only, removed by the caller
        return zeroed

    def _any_grad(self) -> bool:
        # At a window's first batch every gradient was just set to None: one now came from the step.
        return any(p.grad is not None for o in self._optimizer_list for g in o.param_groups for p in g["params"])

    def _bypass_problem(self, outputs: Any, raw_step: bool) -> None:
        """The first step backpropagated or stepped an optimizer by itself (`loss.backward()`,
        `optimizer.step()`): an error where the trainer would then do it twice or never step, else
        one warning naming what the trainer no longer does."""
        name = type(self).__name__
        did = "called optimizer.step()" if raw_step else "called loss.backward() (gradients appeared)"
        if loss_of(outputs) is not None and not self._backward_in_step:
            raise MisconfigurationError(
                f"{name}.training_step {did} itself and also returned the loss, which the trainer would "
                f"backpropagate a second time. Write instead: {WRITE_INSTEAD}."
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
                f"no loss: nothing would ever update the weights. Write instead: {WRITE_INSTEAD}."
            )
        if raw_step:
            bypassed, instead = BYPASSED, WRITE_INSTEAD
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
        batches = "batch" if max_steps == 1 else "batches"
        warnings.warn(
            f"max_steps={max_steps} counts training steps (batches), not optimizer steps as in Lightning: with "
            f"{n} optimizers Lightning's max_steps=N is max_steps=N/{n} here (when every batch steps each "
            f"optimizer). Keep max_steps={max_steps} if you meant {max_steps} {batches}; silence this with "
            'warnings.filterwarnings("ignore", message="max_steps=")',
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

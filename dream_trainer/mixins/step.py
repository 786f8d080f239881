"""StepMixin: the full training step that every call of `self.training_step` goes through.

The step methods a trainer subclass writes (`training_step`, `validation_step`, `test_step`,
`predict_step`) are wrapped once, when the class is created (`DreamTrainer.__init_subclass__` calls
`wrap_steps`), in a `StepMethod`. Once setup has bound the trainer's steps (`StepMixin._bind_steps`),
`self.training_step` is `_full_training_step`, so the default loop and a user's own `training_loop()`
get the same step: batch on the device, accumulation window, autocast, automatic backward/step, hooks,
counters and metric aggregation. `self.x()` always runs a `def x` of the class: nothing is put on the
instance in a method's place.

It also holds the bad-batch policy (`dream_trainer.bad_batches.BadBatchPolicy`, `_bad_batches`: the spike
detector, the skip list, the rollback), created in `_init_bad_batches` with what it calls on the trainer; the
step calls its `check_loss` once per micro-batch when a spike policy is on (`_spike_check`, None otherwise:
one `is None` test), the optimizer step asks it whether to drop a step, the loop takes its batches through it.
`trainer.spikes` and `trainer.skipped_batches` read its lists.

The step commits at the batch boundary, which the stop control the trainer holds owns
(`dream_trainer.stop_control.StopControl`, `_stop_control`, created by `DreamTrainer._init_stop_control`
with the trainer's reaction to a signal): the step marks the boundary due (`end_batch`), the loop runs it;
`trainer.at_batch_boundary` and `trainer.is_optimizer_step_end` ask it.

It sits above everything a step touches (the window and backward of `OptimizationMixin`, the metrics
of `LoggingMixin`, both under `SetupMixin`, and the snapshot a rollback restores, `StateDictMixin.snapshot`)
and implements `SetupMixin`'s template `_bind_steps`; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType, MethodType
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.bad_batches import BadBatchPolicy
from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.fault_tolerance import StepNotCommitted
from dream_trainer.lightning.hints import lightning_names_explained
from dream_trainer.lightning.step_checks import FirstStepCheck, adapt_step, max_steps_note, skipped_note
from dream_trainer.mixins.optimizer_step import _RetryBatch
from dream_trainer.mixins.state_dict import StateDictMixin
from dream_trainer.utils.step_outputs import ends_epoch, loss_of, nothing_logged_note
from dream_trainer.utils.tensors import move_to_device
from dream_trainer.utils.warn import warn_at, warn_user

if TYPE_CHECKING:
    from dream_trainer.stop_control import StopControl

STEP_NAMES = ("training_step", "validation_step", "test_step", "predict_step")
"""The step methods `wrap_steps` wraps."""


class StepMethod:
    """A step method of a trainer subclass, as its class holds it (see `wrap_steps`).

    Read on a trainer that setup has bound (`StepMixin._bind_steps`), the most-derived definition
    returns the trainer's full step: `_full_training_step` (which calls this function),
    `_full_validation_step`, or a `test_step`/`predict_step` written without `batch_idx` adapted to the
    loops' call. Read anywhere else, it is the plain method: before setup, on the class
    (`MyTrainer.training_step` is the function), and through `super().training_step(...)`, which
    reaches the parent's definition (a descriptor setup did not bind) rather than the full step again.
    `training_step` is the plain method also while an evaluation runs and while a training step runs
    (`StepMixin._steps_inside`): Lightning's `validation_step` that returns `self.training_step(...)`
    computes the loss, and never backpropagates or steps an optimizer.
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__
        self.__wrapped__ = function

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self.function
        full = obj._full_steps.get(self)  # empty until setup bound the steps
        return full if full is not None else MethodType(self.function, obj)

    # The class's descriptor is the key of `_full_steps`: a copied trainer keeps it.
    def __copy__(self) -> StepMethod:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> StepMethod:
        return self


def _defining_class(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def wrap_steps(cls: type) -> None:
    """Wrap, in a `StepMethod` on `cls`, each step method `cls` resolves to a plain function of the
    user's (its own, or one of a base class outside the package's mixins). Runs when a trainer class is
    created, and again at setup for a step assigned to the class after that; idempotent."""
    for name in STEP_NAMES:
        owner = _defining_class(cls, name)
        if owner is None or owner.__module__.startswith("dream_trainer.mixins."):
            continue  # the package's default (no step written)
        value = vars(owner)[name]
        if inspect.isfunction(value):
            setattr(cls, name, StepMethod(value))


def _step_method(cls: type, name: str) -> StepMethod | None:
    """The `StepMethod` `cls` resolves `name` to (None: the package's default, or something else)."""
    owner = _defining_class(cls, name)
    value = None if owner is None else vars(owner)[name]
    return value if isinstance(value, StepMethod) else None


class StepMixin(StateDictMixin):
    """The per-batch machinery around the user's `training_step` and `validation_step`, and the bad-batch
    policy it holds.

    The first step of every `fit()` takes one visible branch (`_call_user_step`) that runs the user's
    step under the checks of `dream_trainer/lightning/step_checks.py`; later steps take the other
    branch, at no cost.
    """

    _full_steps: Mapping[StepMethod, Callable[..., Any]] = MappingProxyType({})
    """Per `StepMethod` of the class, what reading it on this trainer returns now: `_steps_outside`, or
    `_steps_inside` while an evaluation or a training step runs."""
    _steps_outside: Mapping[StepMethod, Callable[..., Any]] = MappingProxyType({})
    """The full steps setup bound (`_bind_steps`): what the loops and a custom `training_loop()` read."""
    _steps_inside: Mapping[StepMethod, Callable[..., Any]] = MappingProxyType({})
    """`_steps_outside` without the training step: inside an evaluation, or inside a training step,
    `self.training_step` is the user's method (the full step there would backpropagate under no_grad,
    or run a second step inside the first)."""

    _stop_control: StopControl
    """The batch boundary and the signals acted on there (`dream_trainer.stop_control`): created by
    `DreamTrainer._init_stop_control`, the layer above, which gives it the trainer's reaction to a signal
    (`CheckpointMixin._stop_on_signal`, beside this class)."""

    def _init_bad_batches(self) -> None:
        """The bad-batch policy (spike detector, skip list, rollback: `dream_trainer.bad_batches`), which
        registers its run state ("bad_batches") itself."""
        policy = BadBatchPolicy(
            self.config,
            self._loop,
            self.parallel,
            self._heartbeat.mark,
            self._state_owners,
            record_in_run=self._record_in_run,
            train_loader=self._raw_train_loader,
            snapshot=self.snapshot,
            restore=self.restore,
            reset_boundary=self._stop_control.reset,
            release_logs=self._release_held_logs,
        )
        self._bad_batches = policy
        # The two calls of the hot path, bound once (None when their policy is off: one `is None` test).
        self._spike_check: Callable[[Any, int], None] | None = policy.check_loss if policy.watches else None
        self._spike_drop = policy.drops_step if policy.skips else None

    def _raw_train_loader(self) -> Iterable[Any] | None:
        """The training loader as set up (a skipped batch's sample indices are read from its sampler)."""
        return self._train_loader_raw

    @property
    def is_optimizer_step_end(self) -> bool:
        """True when the running training batch completed an accumulation window: its training step is
        done (`global_step` advanced, the optimizers stepped unless the non-finite policy skipped them).
        Read it in `on_train_batch_end`, which fires for every micro-batch: True on the last one of each
        window only (every batch without accumulation). It stays True through the validation that step
        runs; False from the batch boundary on, and outside training."""
        return self._stop_control.due and self._loop.window_pos == 0  # the boundary due, at a window's end

    def at_batch_boundary(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` at the end of the running training batch: after every `on_train_batch_end`
        callback and after the validation this batch's step is due for, before the next batch starts.
        A checkpoint saved there (`trainer.at_batch_boundary(trainer.save_checkpoint, path)`) holds the
        validated weights and the RNG state the next batch starts from. Called when no training batch
        is ending (an epoch hook, outside `fit()`), it runs `fn` now. Requests run in order; one made
        by `fn` itself runs at once."""
        self._stop_control.defer(fn, args)

    @property
    def spikes(self) -> list[dict[str, Any]]:
        """Every loss spike detected: `epoch`, `batch_idx`, `global_step`, `action` ("warned", "skipped",
        "rolled back") and, under DDP with "skip" or "rollback", the `ranks` whose loss spiked. Read-only."""
        return self._bad_batches.spikes

    @property
    def skipped_batches(self) -> list[dict[str, Any]]:
        """Every batch training dropped: `epoch`, `batch_idx`, `global_step`, `reason` ("spike",
        "non_finite") and the batch's `sample_indices` where the sampler can say (docs/bad-batches.md).
        In checkpoints and run.json. Read-only."""
        return self._bad_batches.skipped_batches

    def _bind_steps(self) -> None:
        cls = type(self)
        wrap_steps(cls)  # a step assigned to the class after it was created
        name = cls.__name__
        full: dict[StepMethod, Callable[..., Any]] = {}
        train = _step_method(cls, "training_step")
        # Signatures are read here, once (a step without batch_idx gets an adapter), never per batch.
        self._user_training_step: Callable[..., Any] = adapt_step(
            name, "training_step", MethodType(train.function, self) if train else cls.training_step.__get__(self)
        )
        if train is not None:
            full[train] = self._full_training_step
        val = _step_method(cls, "validation_step")
        if val is not None:
            self._user_validation_step: Callable[..., Any] = adapt_step(
                name, "validation_step", MethodType(val.function, self)
            )
            full[val] = self._full_validation_step
        for method in ("test_step", "predict_step"):  # test()/predict() call them through the adapter
            own = _step_method(cls, method)
            if own is not None:
                bound = MethodType(own.function, self)
                adapted = adapt_step(name, method, bound)
                if adapted is not bound:
                    full[own] = adapted
        self._steps_outside = full
        self._steps_inside = {k: v for k, v in full.items() if k is not train}
        self._full_steps = full
        self._max_steps_noted: bool = False  # the max_steps migration warning, once per trainer
        self._nothing_logged_noted: set[str] = set()  # the stages whose empty results were said
        self._move_batches: bool = self.device.type != "cpu"  # CPU batches are already where they belong
        self._non_blocking: bool = self.device.type == "cuda"
        self._max_retries: int = self.config.max_non_finite_retries
        # The body each batch runs, chosen here once: `_step_body` (None), or the one a setting needs.
        self._step_variant: Callable[[Any, int], Any] | None = None
        if self._closure_optimizers:  # LBFGS & co. (setup refused retries with them)
            if self._fault_tolerance is not None:
                raise MisconfigurationError(
                    f"{name}: an optimizer that steps with a closure (LBFGS) is not supported with fault_tolerance, "
                    "whose quorum commits one gradient per step: use another optimizer, or fault_tolerance=None."
                )
            self._step_variant = self._closure_step_body
        elif self.config.non_finite_grads == "retry":
            self._step_variant = self._step_with_retries
        self._arm_step_output_check()

    # --- training ---------------------------------------------------------------------------------
    def _full_training_step(self, batch: Any, batch_idx: int) -> Any:
        stop = self._stop_control
        if stop.due:  # a loop of the user's own: the last batch's boundary, before this one starts
            stop.boundary()
        batch = move_to_device(batch, self.device, self._non_blocking) if self._move_batches else batch
        bus, loop, window = self._bus, self._loop, self._window
        # Where the step is, for a hang watchdog (None without one: no mark). Every rank passes the same marks
        # in the same order (the watchdog compares how far each got): start_batch, training_step, backward,
        # optimizer step, on_train_batch_end.
        marks = self._step_marks
        if marks is not None:
            marks.start_batch("on_train_batch_start")
        if bus.on_train_batch_start and self._batch_start_ends_epoch(batch, batch_idx):
            return None
        if window.advance(batch_idx, loop.epoch_length):  # the batch opens an accumulation window
            self._zero_grads()
        variant = self._step_variant
        # Inside the step, `self.training_step` is the user's method (a step that calls it again, or
        # calls a validation_step that does): two attribute stores, no lookup.
        steps = self._full_steps
        self._full_steps = self._steps_inside
        if marks is not None:
            marks.mark("training_step")
        try:
            outputs = self._step_body(batch, batch_idx) if variant is None else variant(batch, batch_idx)
        except StepNotCommitted:  # fault_tolerance: its quorum dropped the step; the next batch trains its samples
            self._drop_uncommitted_step()
            return None
        finally:
            self._full_steps = steps
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:  # the loss (a tensor of more is not one)
            self._train_metrics.add("loss", outputs)
        elif type(outputs) is dict or isinstance(outputs, Mapping):  # plain dicts skip the ABC check
            self._train_metrics.update(outputs)
        if window.end and self._end_window():  # the training step it counted is a logging step
            self._flush_train_metrics()
        loop.batches_done += 1  # a checkpoint written from on_train_batch_end resumes after this batch
        stop.end_batch()  # its boundary is due: after the validation its step runs (see StopControl)
        if marks is not None:
            marks.mark("on_train_batch_end")
        for fn in bus.on_train_batch_end:
            fn(outputs, batch, batch_idx)
        return outputs

    def _batch_start_ends_epoch(self, batch: Any, batch_idx: int) -> bool:
        """`on_train_batch_start` for every callback that has it; True when one returned Lightning's -1: this
        batch and the rest of the epoch are skipped."""
        for fn in self._bus.on_train_batch_start:
            if (said := fn(batch, batch_idx)) is not None and ends_epoch(said):
                self._loop.skip_epoch()
                return True
        return False

    def _step_body(self, batch: Any, batch_idx: int) -> Any:
        window = self._window
        # Inside an accumulation window DDP must skip gradient sync, and it decides at forward time:
        # the whole step (forward and backward) runs under no_sync (the window's decision).
        no_sync = window.no_sync
        if self._check_next_step:  # the first step of each fit(): Lightning-migration checks
            outputs = self._checked_first_step(batch, batch_idx, no_sync)
        elif no_sync or self._amp_dtype is not None:
            with self._step_context(no_sync):
                outputs = self._user_training_step(batch, batch_idx)
        else:
            outputs = self._user_training_step(batch, batch_idx)
        if not window.backward_in_step:
            loss = outputs if isinstance(outputs, torch.Tensor) else loss_of(outputs)
            if loss is not None:
                self.backward(loss)
        if self._spike_check is not None:  # spike_policy set: the loss joins its statistic (no sync but "skip"'s)
            self._spike_check(outputs, batch_idx)
        if window.end:
            self._auto_step()
        return outputs

    def _closure_step_body(self, batch: Any, batch_idx: int) -> Any:
        """`_step_body` of a trainer with an optimizer that steps only with a closure (LBFGS; chosen at
        setup). The user's step runs once, as always: that is the closure's first evaluation, whose
        outputs and metrics are the batch's. A returned loss is backpropagated, then the optimizer
        steps with a closure (`_closure_step`) whose first call returns that loss and whose later
        calls run `training_step` again (`_evaluate_again`). A step that stepped its optimizers itself
        (`self.step(opt, closure=...)`) is left as it is. Accumulation is refused with a closure, so
        every batch ends its window."""
        window = self._window
        if self._check_next_step:
            outputs = self._checked_first_step(batch, batch_idx, False)
        else:
            with self._step_context(False):
                outputs = self._user_training_step(batch, batch_idx)
        if window.manual_step:
            if not window.backward_in_step and (loss := loss_of(outputs)) is not None:
                self.backward(loss)
            return outputs
        if window.backward_in_step:  # self.backward(loss) and no self.step: LBFGS cannot step from that
            closure_opt = next(iter(self._closure_optimizers))
            raise MisconfigurationError(f"{type(self).__name__}.training_step: " + self._closure_needed(closure_opt))
        loss = loss_of(outputs)
        if loss is None:
            return outputs
        if len(self._optimizer_list) != 1:
            names = ", ".join(f"self.{self.optimizer_name(o)}" for o in self._optimizer_list)
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step returned the loss for {len(self._optimizer_list)} optimizers "
                f"({names}), one of which steps only with a closure: step each yourself, "
                "self.step(opt, closure=closure) for that one (the trainer builds a closure for one optimizer)."
            )
        self.backward(loss)
        optimizer = self._optimizer_list[0]
        self._closure_step(optimizer, lambda: self._evaluate_again(batch, batch_idx), first=loss.detach())
        return outputs

    def _evaluate_again(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """A later evaluation of the automatic closure: `training_step` again (under autocast), its loss
        backpropagated. What it logs through `self.log` is dropped: the batch's metrics are its first
        evaluation's (the loss `optimizer.step(closure)` returns, where a plain loop reads it)."""
        with self._training_metrics_dropped(), self._step_context(False):
            outputs = self._user_training_step(batch, batch_idx)
        loss = loss_of(outputs)
        if loss is None:
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step returned no loss when the optimizer's closure evaluated it "
                "again (it did the first time): return the loss every time it runs."
            )
        self.backward(loss)
        return loss.detach()

    def _step_context(self, no_sync: bool) -> contextlib.ExitStack[Any]:
        """What the user's step runs under, entered: DDP's no_sync inside a window, autocast with AMP."""
        stack = contextlib.ExitStack()
        if no_sync:
            stack.enter_context(self._no_sync(self._sync_models))
        if self._amp_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self._amp_dtype))
        return stack

    # --- the first step's checks (their code: dream_trainer/lightning/step_checks.py) ----------------
    def _arm_step_output_check(self) -> None:
        """Check the next training step (at setup, and at the start of every `fit()`)."""
        self._check_next_step: bool = True
        self._skip_noted: bool = False  # a skipped first step was said (once per fit)

    def _checked_first_step(self, batch: Any, batch_idx: int, no_sync: bool) -> Any:
        """The user's step run once under a `FirstStepCheck`, which then raises or warns about what it did.
        A step that skipped its batch (None, nothing backpropagated) is said once; the next step is checked."""
        self._check_next_step = False
        self._note_max_steps()
        window = self._window
        check = FirstStepCheck(type(self).__name__, self._optimizer_list, self.optimizer_name, window.steps)
        # A ported `self.manual_backward(loss)` fails here with the name to write instead.
        with lightning_names_explained(self), self._watching(check), check.watching(), self._step_context(no_sync):
            outputs = self._user_training_step(batch, batch_idx)
        judged = check.judge(
            outputs,
            backward_in_step=window.backward_in_step,
            manual_step=window.manual_step,
            window_pos=window.pos,
            window_end=window.end,
            any_grad=self._any_grad,
        )
        if not judged:  # a skipped batch (right after a resume, say): check the next step instead
            self._check_next_step = True
            if not self._skip_noted:
                self._skip_noted = True
                warn_at(type(self).training_step, skipped_note(type(self).__name__, batch_idx))
        return outputs

    def _any_grad(self) -> bool:
        # At a window's first batch every gradient was just set to None: one now came from the step.
        return any(p.grad is not None for o in self._optimizer_list for g in o.param_groups for p in g["params"])

    def _note_max_steps(self) -> None:
        """Once per trainer, at the first training step: with several optimizers, `max_steps` counts
        batches here, where Lightning counts optimizer steps."""
        if self._max_steps_noted:
            return
        note = max_steps_note(len(self._optimizer_list), self.config.max_steps)
        if note is not None:
            self._max_steps_noted = True
            warn_user(note)

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
                self._reset_window_for_retry()  # counts the retry

    # --- validation -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _steps_as_written(self) -> Iterator[None]:
        """Around an evaluation loop (validation, the sanity check, test, predict): `self.training_step`
        is the user's method, set once for the loop, so a `validation_step` that returns
        `self.training_step(batch, batch_idx)` (a Lightning habit) computes the loss and trains nothing."""
        before = self._full_steps
        self._full_steps = self._steps_inside
        try:
            yield
        finally:
            self._full_steps = before

    def _note_nothing_logged(self, stage: str, last: Any) -> None:
        """Once per trainer and stage: a validation (or test) ran batches and logged nothing, so its step
        returns no dict and calls no `self.log`; said at that step's `def` line."""
        if stage in self._nothing_logged_noted:
            return
        self._nothing_logged_noted.add(stage)
        step = "validation_step" if stage == "validation" else f"{stage}_step"
        warn_at(getattr(type(self), step), nothing_logged_note(type(self).__name__, step, last))

    def _full_validation_step(self, batch: Any, batch_idx: int, *dataloader_idx: int) -> Any:
        # `dataloader_idx` is passed only with several validation loaders, to a step that takes it.
        if self._move_batches:
            batch = move_to_device(batch, self.device, self._non_blocking)
        if self._amp_dtype is None:
            return self._user_validation_step(batch, batch_idx, *dataloader_idx)
        with torch.autocast(self.device.type, dtype=self._amp_dtype):
            return self._user_validation_step(batch, batch_idx, *dataloader_idx)

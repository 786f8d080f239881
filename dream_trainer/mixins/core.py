"""TrainerCore: the state every concern of the trainer shares, and how the mixins are layered.

Every attribute of the trainer is created and written by exactly one class, in its `_init_*` method (or,
for what exists only once `fit()` set the trainer up, in the setup method of that class), with its type
written where it is created; another class that must change it calls a method of that owner
(`tests/test_ownership.py` checks it). The run state a checkpoint saves is registered by its owner in
the same `_init_*` method, in `_state_owners` (see `dream_trainer.run_state`). A mixin that uses what
another one creates inherits from it, so the type checker sees every cross-mixin access and the class
statement states each mixin's dependencies. Python's MRO merges the diamonds; nothing is declared twice.

The layers, each inheriting from those it uses (`A(B, C)`: A uses B and C):

    TrainerCore                              config, callbacks, _loop, _window (the accumulation window),
    |                                        _bus, should_stop, the registry of state owners; discovery:
    |                                        named_models / optimizers / schedulers
    DistributedMixin(TrainerCore)            process identity, device, strategy (`parallel`), _sync_models,
    |                                        collectives, model/loader wrapping, apply_fully_shard
    +- MetricsMixin(DistributedMixin)        torchmetrics attributes, placed and computed per phase
    +- StateFormatMixin(DistributedMixin)    model/optimizer state in the strategy-independent format
    +- AMPMixin(DistributedMixin)            autocast dtype, the fp16 GradScaler, autocast()
    +- RunDirectoryMixin(DistributedMixin)   run_dir: claimed or continued, its lock and run.json
       SchedulerMixin(TrainerCore)           LR schedulers (per step, per epoch), lr_at_step
       OptimizerStepMixin(SchedulerMixin, AMPMixin)   the optimizers bound at setup; one optimizer step:
       |                                     clipping, the non-finite policy, the closure step (LBFGS)
       OptimizationMixin(OptimizerStepMixin) backward, step inside the accumulation window
       |                                     (`dream_trainer.accumulation`, whose state owner it
       |                                     registers), optimizers(), lr_schedulers(), toggle_optimizer()
       LoggingMixin(OptimizationMixin, MetricsMixin, RunDirectoryMixin)   self.log and its options,
       |                                     metric aggregation, callback_metrics, loggers
       +- ResumeMixin(LoggingMixin)          checkpoint_dir; the run fit() opens, the checkpoint it resumes
       SetupMixin(LoggingMixin)              configure_*, training_step/validation_step (what the user
       |                                     writes), the loaders, wrap_model, the setup phase `_setup_fit`
       +- StateDictMixin(StateFormatMixin, SetupMixin)                state_dict / load_state_dict; snapshot / restore
       |  CheckpointMixin(StateDictMixin, ResumeMixin)   files; the reaction to a signal (`_stop_on_signal`)
       |  StepMixin(StateDictMixin)             the full training step of every batch; holds the bad-batch
       |                                     policy (`dream_trainer.bad_batches.BadBatchPolicy`);
       |                                     `at_batch_boundary`, `is_optimizer_step_end` (asked of `_stop_control`)
          EvaluationMixin(StepMixin, CheckpointMixin)                  validation / test / predict loops
    HooksMixin                               the trainer's no-op hooks: uses nothing, inherits nothing

`DreamTrainer` (trainer.py) lists them all, most derived first, and adds the loop and the two objects of
a fit's life it assembles from them: the stop control (`dream_trainer.stop_control.StopControl`,
`_stop_control`: the batch boundary, where a step commits, and the signals acted on there, given
`CheckpointMixin._stop_on_signal` as its reaction) and the run watch (`dream_trainer.run_watch.RunWatch`,
`_run_watch`: the hang watchdog thread of a distributed fit, which the stop control asks where the ranks
agree to stop). Checkpointing and evaluation set the trainer up on demand: `_setup_fit` lies below them,
so they call it directly.

Where a lower layer must call a higher one, the lower layer declares the method, raising
`NotImplementedError`, and the one mixin that owns it overrides it: one declaration, one
implementation, nothing the checker cannot see. There are three:

- `SchedulerMixin._latest_metrics()`, implemented by `LoggingMixin` (`callback_metrics`): what a
  `ReduceLROnPlateau` scheduler monitors.
- `SchedulerMixin._train_epoch_length()`, implemented by `SetupMixin`: the training epoch's length that
  `estimated_stepping_batches` counts the run's steps from (read in `configure_optimizers`, it loads the
  loaders first).
- `SetupMixin._bind_steps()`, implemented by `StepMixin`: setup binds the full training step that
  `self.training_step` returns from then on (see `dream_trainer.mixins.step.StepMethod`).

A lower layer that reads an attribute a higher one owns declares its type in the class body, without a
value: `LoggingMixin` reads `_in_validation`, `_eval_phase` and `_val_batch_size` (where `self.log`
sends a value), which `EvaluationMixin` creates and sets while an evaluation runs; `StepMixin` reads
`_stop_control`, and `TrainerCore` declares `_step_marks`, which `DreamTrainer` creates and sets.

The hot path (`StepMixin._full_training_step`/`_step_body`, `OptimizationMixin.backward`,
`_zero_grads`, `_end_window`, `OptimizerStepMixin._optimizer_step`, `AccumulationWindow.advance`) reads plain instance
attributes only: the layering exists for the type checker and the reader and adds nothing to a step. No
class of a trainer defines `__getattr__` (CPython 3.11 specialises no attribute read of such a class): a
forgotten `super().__init__(config)` is named when the trainer is constructed, by a wrapper around each
trainer class's own `__init__` (`TrainerCore.__init_subclass__`, `checked_init`), which the step never
reaches.

Lightning compatibility lives in `dream_trainer.lightning`, which no mixin inherits from. The core
reaches it at named seams only: setup (`lightning_names_explained`, `refuse_never_called`, the
`configure_optimizers` return forms read by `OptimizationMixin._register_returned`), the one branch of
the step that runs the first-step checks (`StepMixin._step_body`), the step signatures read at
setup (`StepMixin._bind_steps`), and `CheckpointMixin.load_from_checkpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Self, cast

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from dream_trainer.accumulation import AccumulationWindow
from dream_trainer.callbacks.bus import CallbackBus, CallbackList, empty_bus
from dream_trainer.config import DreamTrainerConfig
from dream_trainer.loop_state import LoopState
from dream_trainer.run_state import StateRegistry
from dream_trainer.utils.heartbeat import Heartbeat

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


def is_torchmetric(obj: object) -> bool:
    """True for torchmetrics `Metric` and `MetricCollection` (checked without importing torchmetrics)."""
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, (tm.Metric, tm.MetricCollection))


class TrainerCore:
    """The shared state: the config, the callbacks and their bus, the loop's position, the stop flag,
    and the registry of the run's state owners (`dream_trainer.run_state`).

    Models, optimizers and schedulers are found by type among the public attributes of the trainer,
    in assignment order; there is nothing to register.
    """

    _step_marks: Heartbeat | None
    """The heartbeat the training step marks where it is: `_heartbeat` while a hang watchdog reads it, None
    otherwise (then the per-batch path marks nothing: one test of a local per mark, no call). Created and
    set by `DreamTrainer` when `fit()` starts and stops the watchdog (its `RunWatch`), a choice made once per fit."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The `__init__` a trainer class defines in its body is wrapped once, here: when the outermost
        # `__init__` of a construction returns and `_init_core` never ran, it names the forgotten
        # `super().__init__(config)`. Not a `__getattr__`: CPython 3.11 specialises no attribute read of an
        # instance whose class has one (each read of the trainer ~2.4x slower: +1.5-2 us per training step).
        super().__init_subclass__(**kwargs)
        init = vars(cls).get("__init__")
        if inspect.isfunction(init) and not hasattr(init, _CHECKED):
            cls.__init__ = checked_init(cls, init)  # type: ignore[method-assign]

    def _init_core(self, config: DreamTrainerConfig) -> None:
        if not isinstance(config, DreamTrainerConfig):
            raise TypeError(
                f"{type(self).__name__}(config) needs a DreamTrainerConfig (or a dataclass subclass of it); "
                f"got {type(config).__name__}"
            )
        self.config: DreamTrainerConfig = config
        self.callbacks: CallbackList = CallbackList(config.callbacks)
        max_steps = config.max_steps if config.max_steps is not None else float("inf")
        self._window: AccumulationWindow = AccumulationWindow(config.gradient_accumulation_steps)
        """The gradient accumulation window (`dream_trainer.accumulation`): its own object, which alone changes
        its fields; the step advances it, the optimization verbs note what they did in it, `OptimizationMixin`
        registers its run state, the loop reads it."""
        self._loop: LoopState = LoopState(
            log_every_n_steps=config.log_every_n_steps, max_steps=max_steps, window=self._window
        )
        """Where the loop is; the public read-only view is `trainer.loop`."""
        self.should_stop: bool = False
        self._bus: CallbackBus = empty_bus()
        """Per-hook dispatch tuples; every hook empty until `_build_bus()` runs at setup."""
        self._state_owners: StateRegistry = StateRegistry()
        """What checkpoints save and a tuning run puts back: each mixin registers the state it owns."""
        self._heartbeat: Heartbeat = Heartbeat()
        """Where the main thread is (a step, a hook, a fetch, a save: `_heartbeat.mark(...)`), for the hang
        watchdog's thread (`dream_trainer.run_watch`); a mark is two attribute stores."""

    def _build_bus(self) -> None:
        """Build the dispatch tuples of `callbacks` and the trainer's overridden hooks (at setup)."""
        # Mixins are only ever instantiated as part of a DreamTrainer, which the bus hands to callbacks.
        self._bus = CallbackBus(cast("TrainerProtocol", self), self.callbacks, self._heartbeat)

    @contextlib.contextmanager
    def _callbacks_muted(self) -> Iterator[None]:
        """No callback fires inside the block (the trainer's own hooks still do): a tuning run."""
        bus = self._bus
        self._bus = CallbackBus(cast("TrainerProtocol", self), [], self._heartbeat)
        try:
            yield
        finally:
            self._bus = bus

    @property
    def state_owners(self) -> StateRegistry:
        """The run's state owners by name: what a checkpoint saves besides the models, optimizers and
        schedulers, and what a tuning run puts back (see `dream_trainer.run_state`). A trainer with
        state of its own registers an owner for it here, in `__init__`."""
        return self._state_owners

    # --- discovery --------------------------------------------------------------------------------
    @property
    def trainer(self) -> Self:
        """The trainer itself: a LightningModule's `self.trainer.x` ported here reads `self.x` (the
        trainer is both the module and the trainer)."""
        return self

    def _public_attributes(self) -> Iterable[tuple[str, Any]]:
        return ((k, v) for k, v in vars(self).items() if not k.startswith("_"))

    def named_models(self) -> list[tuple[str, nn.Module]]:
        """`(attribute name, module)` for every `nn.Module` assigned to the trainer (metrics excluded)."""
        return [(k, v) for k, v in self._public_attributes() if isinstance(v, nn.Module) and not is_torchmetric(v)]

    def named_optimizers(self) -> list[tuple[str, Optimizer]]:
        """`(attribute name, optimizer)` for every optimizer assigned to the trainer."""
        return [(k, v) for k, v in self._public_attributes() if isinstance(v, Optimizer)]

    def named_schedulers(self) -> list[tuple[str, Any]]:
        """`(attribute name, scheduler)` for every LR scheduler assigned to the trainer."""
        return [(k, v) for k, v in self._public_attributes() if isinstance(v, (LRScheduler, ReduceLROnPlateau))]


# --- a trainer class's own __init__, checked: did it reach `super().__init__(config)`? ---------------------
_CHECKED = "__dream_trainer_checked__"
"""Marks a wrapper `checked_init` made (a class that reuses another's `__init__` is not wrapped twice)."""

_CONSTRUCTING: dict[int, type | None] = {}
"""`id(trainer)` of each trainer whose outermost checked `__init__` is running, and the class whose own
`__init__` returned (or failed reading the trainer) without `_init_core` having run, None until one did."""


def _core_ran(trainer: object) -> bool:
    return "_state_owners" in vars(trainer)  # `_init_core` creates it


def _missing_super(owner: type, read: str | None) -> str:
    name = f"{owner.__name__}.__init__"
    early = "" if read is None else f" (or read self.{read} before it did)"
    return (
        f"{name} did not call super().__init__(config){early}: call super().__init__(config) first in {name}; "
        "it creates the trainer's state."
    )


def _run_checked(
    cls: type, init: Callable[..., None], trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """`init(trainer, *args, **kwargs)`, `cls`'s own `__init__`. The outermost call of a construction (a
    subclass's `super().__init__` is an inner one) raises if `_init_core` never ran, naming the innermost
    `__init__` that returned without it, or that read the trainer before it (an `AttributeError` of the
    trainer's, chained)."""
    key = id(trainer)
    outermost = key not in _CONSTRUCTING
    if outermost:
        _CONSTRUCTING[key] = None
    try:
        try:
            init(trainer, *args, **kwargs)
        except AttributeError as exc:
            if exc.obj is not trainer or _core_ran(trainer):
                raise
            culprit = _blame(key, cls)
            if not outermost:
                raise
            raise AttributeError(_missing_super(culprit, exc.name), name=exc.name, obj=trainer) from exc
        if not _core_ran(trainer):
            culprit = _blame(key, cls)
            if outermost:
                raise AttributeError(_missing_super(culprit, None), obj=trainer)
    finally:
        if outermost:
            del _CONSTRUCTING[key]


def _blame(key: int, cls: type) -> type:
    """The class named for the trainer `key`: the first (innermost) `__init__` to report stays."""
    culprit = _CONSTRUCTING[key] or cls
    _CONSTRUCTING[key] = culprit
    return culprit


def checked_init(cls: type, init: Callable[..., None]) -> Callable[..., None]:
    """`init` (the `__init__` defined in `cls`'s body) as `functools.wraps` keeps it (name, docstring,
    `inspect.signature`), which, once the outermost `__init__` of a construction returned, raises if
    `super().__init__(config)` was never reached (`_init_core` did not run). Construction only: the
    trainer's attribute reads and its step never pass through it."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        run(cls, init, self, args, kwargs)  # closure variables only: the globals are `init`'s (below)

    run = _run_checked
    # The wrapper's globals are those of `init`: code that evaluates the string annotations of
    # `cls.__init__` in `cls.__init__.__globals__` (the CLI's `config_class_of`) finds the user's names.
    wrapper = types.FunctionType(__init__.__code__, init.__globals__, "__init__", None, __init__.__closure__)
    functools.update_wrapper(wrapper, init)
    setattr(wrapper, _CHECKED, True)
    return wrapper

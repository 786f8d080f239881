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
    +- SignalMixin(DistributedMixin)         SIGTERM/SIGINT handlers; the ranks agree to stop
    |  BatchEndMixin(SignalMixin)            the batch boundary: at_batch_boundary's work, the signal check
    +- MetricsMixin(DistributedMixin)        torchmetrics attributes, placed and computed per phase
    +- StateFormatMixin(DistributedMixin)    model/optimizer state in the strategy-independent format
    +- AMPMixin(DistributedMixin)            autocast dtype, the fp16 GradScaler, autocast()
    +- RunDirectoryMixin(DistributedMixin)   run_dir: claimed or continued, its lock and run.json
    |  WatchdogMixin(RunDirectoryMixin, SignalMixin)   the hang watchdog thread of a distributed fit;
    |                                        the store the ranks agree to stop through
       BadBatchMixin(AMPMixin, RunDirectoryMixin)   the loss-spike detector, the skip list
       SchedulerMixin(TrainerCore)           LR schedulers (per step, per epoch), lr_at_step
       OptimizerStepMixin(SchedulerMixin, BadBatchMixin)   the optimizers bound at setup; one optimizer
       |                                     step: clipping, the non-finite policy, the closure step (LBFGS)
       OptimizationMixin(OptimizerStepMixin) backward, step inside the accumulation window
       |                                     (`dream_trainer.accumulation`, whose state owner it
       |                                     registers), optimizers(), lr_schedulers(), toggle_optimizer()
       LoggingMixin(OptimizationMixin, MetricsMixin, RunDirectoryMixin)   self.log and its options,
       |                                     metric aggregation, callback_metrics, loggers
       +- ResumeMixin(LoggingMixin)          checkpoint_dir; the run fit() opens, the checkpoint it resumes
       SetupMixin(LoggingMixin)              configure_*, training_step/validation_step (what the user
       |                                     writes), the loaders, wrap_model, the setup phase `_setup_fit`
       +- StateDictMixin(StateFormatMixin, SetupMixin)                state_dict / load_state_dict
       |  CheckpointMixin(StateDictMixin, ResumeMixin, SignalMixin)   files, the save on a signal
       +- StepMixin(SetupMixin, BatchEndMixin)                         the full training step of every batch
          EvaluationMixin(StepMixin, CheckpointMixin)                  validation / test / predict loops
    HooksMixin                               the trainer's no-op hooks: uses nothing, inherits nothing

`DreamTrainer` (trainer.py) lists them all, most derived first, and adds the loop. Checkpointing and
evaluation set the trainer up on demand: `_setup_fit` lies below them, so they call it directly.

Where a lower layer must call a higher one, the lower layer declares the method, raising
`NotImplementedError`, and the one mixin that owns it overrides it: one declaration, one
implementation, nothing the checker cannot see. There are three:

- `SchedulerMixin._latest_metrics()`, implemented by `LoggingMixin` (`callback_metrics`): what a
  `ReduceLROnPlateau` scheduler monitors.
- `SetupMixin._bind_steps()`, implemented by `StepMixin`: setup binds the full training step that
  `self.training_step` returns from then on (see `dream_trainer.mixins.step.StepMethod`).
- `SignalMixin._stop_on_signal()`, implemented by `CheckpointMixin`: once a signal arrived, save and
  leave `fit()` (raising `TrainingInterrupted`, which lives in `errors.py`).

A lower layer that reads an attribute a higher one owns declares its type in the class body, without a
value: `LoggingMixin` reads `_in_validation`, `_eval_phase` and `_val_batch_size` (where `self.log`
sends a value), which `EvaluationMixin` creates and sets while an evaluation runs; `SignalMixin` reads
`_watchdog`, which `WatchdogMixin` starts and stops with `fit()`.

The hot path (`StepMixin._full_training_step`/`_step_body`, `OptimizationMixin.backward`,
`_zero_grads`, `_end_window`, `OptimizerStepMixin._optimizer_step`, `AccumulationWindow.advance`) reads plain instance
attributes only: the layering exists for the type checker and the reader and adds nothing to a step. No
class of an initialised trainer defines `__getattr__` (CPython 3.11 specialises no attribute read of
such a class): the hook that names a forgotten `super().__init__(config)` lives on the class a trainer is
created as until that call (`TrainerCore.__new__`, `_become_ready`).

Lightning compatibility lives in `dream_trainer.lightning`, which no mixin inherits from. The core
reaches it at named seams only: setup (`lightning_names_explained`, `refuse_never_called`, the
`configure_optimizers` return forms read by `OptimizationMixin._register_returned`), the one branch of
the step that runs the first-step checks (`StepMixin._step_body`), the step signatures read at
setup (`StepMixin._bind_steps`), and `CheckpointMixin.load_from_checkpoint`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Self, cast

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from dream_trainer.accumulation import AccumulationWindow
from dream_trainer.callbacks.bus import CallbackBus, CallbackList, empty_bus
from dream_trainer.config import DreamTrainerConfig
from dream_trainer.loop_state import LoopState
from dream_trainer.run_state import StateRegistry
from dream_trainer.utils.watchdog import Heartbeat

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
    set by `WatchdogMixin` when `fit()` starts and stops the watchdog, a choice made once per fit."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # A trainer is created as `_unready_class(cls)`: `cls` itself plus a `__getattr__` that names a
        # forgotten `super().__init__(config)`; `_init_core` makes it a plain `cls`. The attribute hook
        # must not stay on the class: CPython 3.11 specialises no attribute read of an instance whose class
        # has a `__getattr__` (each read of the trainer ~2.4x slower: +1.5-2 us per training step).
        return cast("Self", object.__new__(_unready_class(cls)))

    def _init_core(self, config: DreamTrainerConfig) -> None:
        self._become_ready()  # the first thing `super().__init__(config)` does
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
        watchdog's thread (`dream_trainer.mixins.watchdog`); a mark is two attribute stores."""

    def _become_ready(self) -> None:
        """The instance was created as its class's not-yet-initialised twin (see `__new__`): from now on it
        is an instance of the class itself."""
        ready = vars(type(self)).get("_ready_class")
        if ready is not None:
            object.__setattr__(self, "__class__", ready)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # `copy.deepcopy` and unpickling create the instance through `__new__` (a twin), then set its state.
        self.__dict__.update(state)
        if "_state_owners" in state:
            self._become_ready()

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


# --- a trainer whose __init__ has not reached `super().__init__(config)` yet ---------------------------------
_UNREADY: dict[type, type] = {}


def _missing_init(self: Any, name: str) -> Any:
    """`__getattr__` of a trainer not yet initialised: reached only when the normal lookup failed."""
    cls = type(self)
    if not (name.startswith("__") and name.endswith("__")):
        raise AttributeError(
            f"{cls.__name__}.__init__ did not call super().__init__(config) (or read self.{name} before it did): "
            f"call super().__init__(config) first in {cls.__name__}.__init__; it creates the trainer's state.",
            name=name,
            obj=self,
        )
    for klass in cls.__mro__:  # a property that raised AttributeError: let its own message through
        if name in vars(klass):
            attr = vars(klass)[name]
            if hasattr(type(attr), "__get__"):
                return attr.__get__(self, cls)
            break
    raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}", name=name, obj=self)


def is_unready_class(cls: type) -> bool:
    """True for the not-yet-initialised twin of a trainer class (`TrainerCore.__new__`), which
    `DreamTrainer.__init_subclass__` leaves as it is (its steps are the class's own)."""
    return "_ready_class" in vars(cls)


def _unready_class(cls: type) -> type:
    """`cls` plus a `__getattr__` that says a missing `super().__init__(config)` (made once per class)."""
    if is_unready_class(cls):
        return cls
    twin = _UNREADY.get(cls)
    if twin is None:
        namespace = {
            "__getattr__": _missing_init,
            "_ready_class": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        twin = _UNREADY[cls] = type(cls.__name__, (cls,), namespace)
    return twin

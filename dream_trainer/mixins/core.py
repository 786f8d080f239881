"""TrainerCore: the state every concern of the trainer shares, and how the mixins are layered.

Every attribute of the trainer is created and written by exactly one class, in its `_init_*` method (or,
for what exists only once `fit()` set the trainer up, in the setup method of that class), with its type
written where it is created; another class that must change it calls a method of that owner
(`tests/test_ownership.py` checks it). The run state a checkpoint saves is registered by its owner in
the same `_init_*` method, in `_state_owners` (see `dream_trainer.run_state`). A mixin that uses what
another one creates inherits from it, so the type checker sees every cross-mixin access and the class
statement states each mixin's dependencies. Python's MRO merges the diamonds; nothing is declared twice.

The layers, each inheriting from those it uses (`A(B, C)`: A uses B and C):

    TrainerCore                              config, callbacks, _loop, _bus, should_stop, the registry of
    |                                        state owners; discovery: named_models / optimizers / schedulers
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
       OptimizationMixin(AMPMixin)           the accumulation window and its flags (and their
       |                                     checkpoint save/restore), backward, step, clipping, schedulers,
       |                                     optimizers(), lr_schedulers(), toggle_optimizer()
       LoggingMixin(OptimizationMixin, MetricsMixin, RunDirectoryMixin)   self.log and its options,
       |                                     metric aggregation, callback_metrics, loggers
       SetupMixin(LoggingMixin)              configure_*, training_step/validation_step (what the user
       |                                     writes), the loaders, wrap_model, the setup phase `_setup_fit`
       +- CheckpointMixin(StateFormatMixin, SetupMixin, SignalMixin)   state_dict, files, the save on a signal
       +- StepMixin(SetupMixin, BatchEndMixin)                         the full training step of every batch
          EvaluationMixin(StepMixin, CheckpointMixin)                  validation / test / predict loops
    HooksMixin                               the trainer's no-op hooks: uses nothing, inherits nothing

`DreamTrainer` (trainer.py) lists them all, most derived first, and adds the loop. Checkpointing and
evaluation set the trainer up on demand: `_setup_fit` lies below them, so they call it directly.

Where a lower layer must call a higher one, the lower layer declares the method, raising
`NotImplementedError`, and the one mixin that owns it overrides it: one declaration, one
implementation, nothing the checker cannot see. There are three:

- `OptimizationMixin._latest_metrics()`, implemented by `LoggingMixin` (`callback_metrics`): what a
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
`_begin_window`, `_end_window`, `_optimizer_step`) reads plain instance attributes only: the layering
exists for the type checker and the reader and adds nothing to a step.

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

    def _init_core(self, config: DreamTrainerConfig) -> None:
        if not isinstance(config, DreamTrainerConfig):
            raise TypeError(
                f"{type(self).__name__}(config) needs a DreamTrainerConfig (or a dataclass subclass of it); "
                f"got {type(config).__name__}"
            )
        self.config: DreamTrainerConfig = config
        self.callbacks: CallbackList = CallbackList(config.callbacks)
        max_steps = config.max_steps if config.max_steps is not None else float("inf")
        self._loop: LoopState = LoopState(log_every_n_steps=config.log_every_n_steps, max_steps=max_steps)
        """Where the loop is; the public read-only view is `trainer.loop`."""
        self.should_stop: bool = False
        self._bus: CallbackBus = empty_bus()
        """Per-hook dispatch tuples; every hook empty until `_build_bus()` runs at setup."""
        self._state_owners: StateRegistry = StateRegistry()
        """What checkpoints save and a tuning run puts back: each mixin registers the state it owns."""
        self._heartbeat: Heartbeat = Heartbeat()
        """Where the main thread is (a step, a hook, a fetch, a save: `_heartbeat.mark(...)`), for the hang
        watchdog's thread (`dream_trainer.mixins.watchdog`); a mark is two attribute stores."""

    if not TYPE_CHECKING:  # for the type checker, a missing attribute stays an error

        def __getattr__(self, name: str) -> Any:
            # Reached only when the normal lookup failed: nothing is added to a lookup that succeeds.
            cls = type(self)
            if "_state_owners" not in self.__dict__ and not (name.startswith("__") and name.endswith("__")):
                raise AttributeError(
                    f"{cls.__name__}.__init__ did not call super().__init__(config) (or read self.{name} before "
                    f"it did): call super().__init__(config) first in {cls.__name__}.__init__; it creates the "
                    "trainer's state.",
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

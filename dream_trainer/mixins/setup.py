"""SetupMixin: what the user writes (`configure_*`, `training_step`, `validation_step`), placing and
wrapping models, the loaders, and the setup phase of `fit()`.

It sits above everything the setup phase calls (distributed, optimization, logging, metrics) and below
the checkpoint and evaluation mixins, which set the trainer up on demand. The one thing it calls above
itself, binding the full training step that `self.training_step` returns from then on, is the template
`_bind_steps`, implemented by `StepMixin`; see `dream_trainer.mixins.core` for the layers.

Lightning compatibility is reached at one seam here: `_setup_fit` runs inside
`lightning_names_explained` and refuses Lightning methods that are never called
(`dream_trainer.lightning.hints`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from dream_trainer.callbacks.bus import check_hook_names
from dream_trainer.datamodule import DataModule, call_stage_hook
from dream_trainer.errors import MisconfigurationError
from dream_trainer.fault_tolerance import QuorumBatches, check_loader
from dream_trainer.lightning.hints import lightning_names_explained, refuse_never_called
from dream_trainer.mixins.logging import LoggingMixin
from dream_trainer.mixins.parallelism import ParallelismMixin
from dream_trainer.utils.data import (
    EpochLoader,
    EpochSource,
    as_loader_list,
    limited_length,
    stop_persistent_workers,
    takes_dataloader_idx,
    unshuffled,
)
from dream_trainer.utils.data_resume import keep_stream_parts
from dream_trainer.utils.modules import has_trainable_parameters
from dream_trainer.utils.seed import seed_everything, use_deterministic_algorithms

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from dream_trainer.protocol import TrainerProtocol


class SetupMixin(LoggingMixin, ParallelismMixin):
    """Finds what the user assigned to `self` (see `TrainerCore`), and runs the setup phase of `fit()`."""

    def _init_setup(self, datamodule: DataModule | None = None) -> None:
        self._is_setup = False
        self._wrapped: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._train_loader_raw: Iterable[Any] | None = None
        self._val_loader_raw: Iterable[Any] | None = None
        self.datamodule: DataModule | None = datamodule
        """Where the loaders come from instead of `configure_dataloaders` (see `dream_trainer.DataModule`)."""
        self._datamodule_stages: set[str] = set()  # the stages `datamodule.setup` ran for
        # Whether the user's validation_step takes `dataloader_idx` (several validation loaders): read
        # from its signature once, at setup, never per batch.
        self._val_step_takes_idx: bool = False
        # Whether setup loaded the loaders of `fit()` (`_load_fit_dataloaders`): where setup loads them, after
        # configure_optimizers, or earlier, when configure_optimizers reads `estimated_stepping_batches`.
        self._fit_loaders_loaded: bool = False
        # What `fit()` needs and setup did not find (no training_step, optimizer or training loader):
        # `validate()`, `test()`, `predict()` and loading weights do without them, as in Lightning;
        # `fit()` raises the first (`_require_fit_ready`).
        self._fit_missing: list[str] = []
        # The stages whose `setup(stage)` hook fired and whose `teardown(stage)` has not yet: "fit", or
        # "validate"/"test"/"predict" around each such call, as Lightning pairs them.
        self._setup_stages: set[str] = set()

    def _use_datamodule(self, datamodule: DataModule) -> None:
        """`fit(datamodule=...)`: the loaders come from `datamodule` (refused once set up with others)."""
        if self._is_setup and datamodule is not self.datamodule:
            raise MisconfigurationError(
                f"{type(self).__name__}.fit(datamodule=...): this trainer is set up with its loaders "
                "already; pass the datamodule to the constructor or to the first fit()."
            )
        self.datamodule = datamodule

    @property
    def is_setup(self) -> bool:
        """True once the setup phase of `fit()` (or `load_checkpoint` on a fresh trainer) has run."""
        return self._is_setup

    # --- user-facing methods to override ---------------------------------------------------------
    def configure_models(self) -> None:
        """Build models and assign them to `self` (optional if `__init__` already did)."""

    def configure_optimizers(self) -> Any:
        """Assign optimizers (and LR schedulers) to `self`. Models are already on the device.

        Or return them in any of Lightning's forms (an optimizer; a list of them; `[optimizers],
        [schedulers]`; `{"optimizer": opt, "lr_scheduler": sched or {"scheduler": sched, "interval":
        "step", "monitor": "val_loss"}}`; a list of such dicts): they are assigned as `optimizer`,
        `optimizer_1`, ... and `lr_scheduler`, ... in that order (see `optimizers()`).
        """
        return None

    def prepare_data(self) -> None:
        """Download or preprocess data (work that writes files): called once per `fit()` setup, on global
        rank zero only, before the `setup` hook; the other ranks wait. As Lightning's `prepare_data`; do
        not assign state here (the other ranks would not have it): do that in `setup` or
        `configure_dataloaders`."""

    def configure_dataloaders(self) -> tuple[Iterable[Any], Iterable[Any] | None]:
        """Return `(train_loader, val_loader or None)`; the validation part may be a list of loaders. Not
        called when the trainer has a `datamodule`: its train and val loaders are used instead. The
        default calls Lightning's `train_dataloader()` and `val_dataloader()` when the trainer defines them."""
        dm = self.datamodule
        if dm is not None:
            return dm.train_dataloader(), dm.val_dataloader()  # type: ignore[return-value]  # None: checked by setup
        # Lightning's data hooks written on the trainer itself.
        train_dataloader = getattr(self, "train_dataloader", None)
        val_dataloader = getattr(self, "val_dataloader", None)
        if callable(train_dataloader) or callable(val_dataloader):
            return (
                train_dataloader() if callable(train_dataloader) else None,  # type: ignore[return-value]  # None: fit says so
                val_dataloader() if callable(val_dataloader) else None,
            )
        if self._train_loader_raw is not None:
            return self._train_loader_raw, self._val_loader_raw
        raise MisconfigurationError(
            f"{type(self).__name__} has no training data: define configure_dataloaders(self) returning "
            "(train_loader, val_loader_or_None), e.g. `return DataLoader(train_ds, batch_size=32, "
            "shuffle=True), DataLoader(val_ds, batch_size=64)` (or Lightning's train_dataloader(self) and "
            "val_dataloader(self), or a DataModule)."
        )

    # The defaults are how setup sees that the user did not write one. A subclass's own steps are wrapped
    # when its class is created (`dream_trainer.mixins.step.StepMethod`): once set up, `self.training_step`
    # is the full step around the user's.
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute the loss of one batch. Either call `self.backward(loss)` (and optionally
        `self.step(optimizer)`), or return the loss (a tensor, or a dict with a `"loss"` entry) and
        the trainer backpropagates and steps for you. Other scalar entries of a returned dict are logged.
        """
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute validation metrics of one batch; return a dict of scalars (e.g. `{"val_loss": loss}`)."""
        raise NotImplementedError

    # Lightning's LightningModule is the model, so its code calls `self(x)`; here the trainer holds the
    # models, and `self(x)` runs the `forward` the user defines on the trainer.
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """What `self(x)` computes: define `forward(self, x)` on your trainer (usually `self.model(x)`)."""
        raise MisconfigurationError(
            f"{type(self).__name__}(...) was called (`self(x)`), which runs forward, but {type(self).__name__} "
            "defines no forward: define forward(self, x) on your trainer, or call self.model(x)."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`self(x)` is `self.forward(x)`, as on a LightningModule."""
        return self.forward(*args, **kwargs)

    def _bind_steps(self) -> None:
        """Bind the full training (and validation) step that reading `self.training_step` returns from
        now on, and read the step signatures; implemented by `StepMixin`."""
        raise NotImplementedError(
            f"{type(self).__name__} has no step machinery: StepMixin implements _bind_steps(); "
            "compose SetupMixin into a trainer that has StepMixin (DreamTrainer does)."
        )

    # --- models -----------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Place `model` on `self.device`, wrap it for the strategy (DDP / FSDP2) and compile it when
        `config.compile_model`; idempotent.

        Returns the module to use in its place (the compiled wrapper, or `model` itself).
        """
        if model in self._wrapped:
            return model
        if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model = model.to(self.device)  # meta-device models are allocated after sharding
        # Distribute first, then compile: PyTorch's recommended order (torch.compile(DDP(model))).
        model = self._distribute_model(model)
        compile_here = self.config.compile_model and not self.parallel.compiles_models
        if compile_here and has_trainable_parameters(model) and not hasattr(model, "_orig_mod"):
            model = cast(nn.Module, torch.compile(model))  # compiling a module gives a module (OptimizedModule)
        self._wrapped.add(model)
        return model

    # --- data -------------------------------------------------------------------------------------
    @property
    def train_loader(self) -> EpochLoader:
        """The training loader; iterating it runs one epoch (hooks, limits, counters)."""
        if self._train_loader_raw is None:
            raise AttributeError("train_loader is set by configure_dataloaders(), which runs in fit()")
        # Mixins are only ever instantiated as part of a DreamTrainer, whose epoch the loader iterates.
        return EpochLoader(cast(EpochSource, self), self._train_loader_raw)

    @train_loader.setter
    def train_loader(self, loader: Iterable[Any]) -> None:
        self._train_loader_raw = loader.loader if isinstance(loader, EpochLoader) else loader

    @property
    def val_loader(self) -> Iterable[Any] | None:
        """The validation loader (None when there is none)."""
        return self._val_loader_raw

    @val_loader.setter
    def val_loader(self, loader: Iterable[Any] | None) -> None:
        self._val_loader_raw = loader

    def use_dataloaders(self, train: Iterable[Any], val: Iterable[Any] | None = None) -> None:
        """Train on `train` and validate on `val` from now on, each made ready for the strategy like the
        loaders `configure_dataloaders` returns (`limit_val_batches=0`: no validation);
        `num_training_batches` follows. `scale_batch_size` calls it with loaders of a new batch size."""
        self._train_loader_raw = self._training_source(train)
        self._val_loader_raw = None if self.config.limit_val_batches == 0 else self._distribute_loader(val, train=False)
        self._loop.set_epoch_length(self._epoch_length())

    def _training_source(self, train: Iterable[Any]) -> Iterable[Any]:
        """The training loader as the loop reads it: made ready for the strategy, or, with `fault_tolerance`,
        read one step's quorum-assigned batch at a time (`dream_trainer.fault_tolerance.QuorumBatches`)."""
        ft = self._fault_tolerance
        if ft is None:
            return self._distribute_loader(train, train=True)
        check_loader(train)
        return QuorumBatches(cast("DataLoader[Any]", train), ft, self._loop)

    def _keep_data_order(self, order: tuple[Any, ...] | None) -> None:
        """A checkpoint being loaded was written with the training order `order`: on one process, a
        DistributedSampler's seeded order is kept (`_keep_order_seed`) and the training loader rebuilt
        with it, so a run begun under data parallelism reads the same samples per step from here on. A stream
        read as the parts of the run's start (`ShardedIterable.read_as_parts`) goes on reading them."""
        keep_stream_parts(self._train_loader_raw, order)
        if self._keep_order_seed(order) and self._train_loader_raw is not None:
            self._train_loader_raw = self._distribute_loader(self._train_loader_raw, train=True)
            self._loop.set_epoch_length(self._epoch_length())

    def _no_training_step(self) -> str | None:
        if type(self).training_step is not SetupMixin.training_step:
            return None
        return (
            f"{type(self).__name__} has no training_step: define `def training_step(self, batch, batch_idx):` "
            "that computes the loss and returns it (or calls self.backward(loss)), e.g. "
            "`x, y = batch; return {'loss': F.cross_entropy(self.model(x), y)}`."
        )

    def _require_fit_ready(self) -> None:
        """Raise what `fit()` needs and setup did not find (see `_fit_missing`)."""
        if self._fit_missing:
            raise MisconfigurationError(self._fit_missing[0])

    def _epoch_length(self) -> int | None:
        assert self._train_loader_raw is not None
        return limited_length(self._train_loader_raw, self.config.limit_train_batches, "limit_train_batches")

    def _train_epoch_length(self) -> int | None:
        """Batches in one training epoch on this process after `limit_train_batches` (None: the loader has no
        length), for `estimated_stepping_batches`. Read while setup runs, before it loads the loaders
        (in `configure_optimizers`), it loads them now, as Lightning does, and setup does not again."""
        if not self._fit_loaders_loaded:
            if not self._setup_stages:  # before fit(): no process group, no models to load the loaders for
                raise MisconfigurationError(
                    f"{type(self).__name__}.estimated_stepping_batches needs the training loader, which fit() "
                    "loads: read it in configure_optimizers or later, not before fit()."
                )
            self._load_fit_dataloaders()
        if self._train_loader_raw is None:
            raise MisconfigurationError(
                self._fit_missing[-1] if self._fit_missing else f"{type(self).__name__} has no training loader."
            )
        return self._epoch_length()

    def _load_fit_dataloaders(self) -> None:
        """The datamodule's `setup("fit")`, then the loaders (`_load_dataloaders`): once, at setup."""
        if self._fit_loaders_loaded:
            return
        self._setup_datamodule("fit")
        self._load_dataloaders()
        self._fit_loaders_loaded = True

    def _load_dataloaders(self) -> None:
        """`configure_dataloaders()` (or the datamodule's), each loader made ready for the strategy; at
        setup, and every `reload_dataloaders_every_n_epochs` epochs."""
        cls, cfg, dm = type(self), self.config, self.datamodule
        # A datamodule given to the trainer wins over an overridden configure_dataloaders, as in Lightning.
        if dm is not None:
            loaders: Any = (dm.train_dataloader(), dm.val_dataloader())
        elif cls.configure_dataloaders is SetupMixin.configure_dataloaders:
            try:  # Lightning's data hooks on the trainer, or the loaders fit() left
                loaders = self.configure_dataloaders()
            except MisconfigurationError as no_data:  # no data at all: evaluation needs none, fit() says so
                self._fit_missing.append(str(no_data))
                loaders = (None, None)
        else:
            loaders = self.configure_dataloaders()
        if isinstance(loaders, (tuple, list)) and len(loaders) == 2:
            train, val = loaders
        else:
            train, val = loaders, None
        if train is None:
            where = (
                "the datamodule's train_dataloader()" if dm is not None else (f"{cls.__name__}.configure_dataloaders")
            )
            self._fit_missing.append(f"{where} returned no training loader; return (train_loader, val_loader or None).")
        if cfg.overfit_batches and train is not None:  # the same first batches every epoch, and validation on them
            train = unshuffled(train)
            val = train
        self._train_loader_raw = None if train is None else self._training_source(train)
        vals = [self._distribute_loader(dl, train=False) for dl in as_loader_list(val)]
        self._val_loader_raw = vals[0] if len(vals) == 1 else vals  # several: validated in turn
        if cfg.limit_val_batches == 0:
            self._val_loader_raw = None

    def _stop_loader_workers(self) -> None:
        """At the exit of a distributed run: the persistent workers of the training and validation loaders
        stop now, before the exit's garbage collection frees them (`utils.data.stop_persistent_workers`)."""
        for loader in (self._train_loader_raw, *as_loader_list(self._val_loader_raw)):
            stop_persistent_workers(loader)

    def _setup_datamodule(self, stage: str) -> None:
        """`prepare_data()` once on global rank zero (the others wait), then `setup(stage)` once per stage."""
        dm = self.datamodule
        if dm is None or stage in self._datamodule_stages:
            return
        if not self._datamodule_stages:
            dm.trainer = cast("TrainerProtocol", self)  # Lightning's `self.trainer` inside a DataModule
            if self.is_global_zero:
                dm.prepare_data()
            self.barrier()
        call_stage_hook(dm.setup, stage)
        self._datamodule_stages.add(stage)

    def _add_default_callbacks(self) -> None:
        """Lightning's defaults, unless turned off or already attached: checkpointing, progress."""
        from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint
        from dream_trainer.callbacks.progress_base import ProgressBarBase
        from dream_trainer.callbacks.rich_progress import default_progress_bar

        if self.config.enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint(save_last=True))
        if self.config.enable_progress_bar and not any(isinstance(c, ProgressBarBase) for c in self.callbacks):
            self.callbacks.append(default_progress_bar())

    # --- the setup phase --------------------------------------------------------------------------
    def _setup_fit(self, stage: str = "fit") -> None:
        """seed -> process group -> `setup(stage)` hook -> configure_models -> place/compile ->
        configure_optimizers -> configure_dataloaders. Runs once; `load_checkpoint` on a fresh trainer
        runs it too; `stage` is the entry point that needs it ("fit", "validate", "test", "predict")."""
        if self._is_setup:
            return
        with lightning_names_explained(self):  # ported `self.parameters()` in configure_optimizers, ...
            self._run_setup(stage)

    def _enter_stage(self, stage: str) -> None:
        """Fire `setup(stage)` unless it fired and `teardown(stage)` has not (setup fires the first)."""
        if stage not in self._setup_stages:
            self._setup_stages.add(stage)
            self._bus.fire("setup", stage)

    def _leave_stage(self, stage: str) -> None:
        """Fire `teardown(stage)`, pairing the `setup(stage)` of this entry point."""
        if stage in self._setup_stages:
            self._setup_stages.discard(stage)
            self._bus.fire("teardown", stage)

    def _run_setup(self, stage: str) -> None:
        cls = type(self)
        check_hook_names(cls, owner="trainer")
        refuse_never_called(cls)  # Lightning's configure_gradient_clipping, training_epoch_end, ...
        problem = self._no_training_step()
        if problem is not None:
            self._fit_missing.append(problem)
        cfg = self.config
        if cfg.seed is not None:
            seed_everything(cfg.seed)
        if cfg.deterministic:
            use_deterministic_algorithms(warn_only=cfg.deterministic == "warn")
        self._init_distributed()
        self._add_default_callbacks()
        self._build_bus()
        if cls.prepare_data is not SetupMixin.prepare_data:
            if self.is_global_zero:
                self.prepare_data()
            self.barrier()  # the others wait for its files
        self._setup_stages.add(stage)
        self._bus.fire("setup", stage)
        self._setup_models()
        self._setup_optimizers()
        self._load_fit_dataloaders()  # unless configure_optimizers read estimated_stepping_batches

        if cls.validation_step is not SetupMixin.validation_step:
            self._val_step_takes_idx = takes_dataloader_idx(cls.validation_step.__get__(self))
        elif self._val_loader_raw is not None:
            raise MisconfigurationError(
                f"{cls.__name__} has a validation loader but no validation_step: define "
                "`def validation_step(self, batch, batch_idx):` returning a dict such as {'val_loss': loss}, "
                "or return None as the validation loader."
            )
        self._setup_metrics()
        self._bind_sync_models()
        if self.is_distributed:
            reduce = self._reduce_sums
            for agg in (self._train_metrics, self._val_metrics):
                agg.reducer, agg.key_union = reduce, self._key_union
        self._bind_steps()
        self._loop.set_epoch_length(None if self._train_loader_raw is None else self._epoch_length())
        self._is_setup = True

    def _setup_models(self) -> None:
        """`configure_models`, then the strategy's parallelism, each model wrapped and its memory allocated."""
        # With init_device="meta" the models cost no memory until the strategy has split them.
        meta = self.config.init_device == "meta"
        with torch.device("meta") if meta else contextlib.nullcontext():
            self.configure_models()
        self._use_strategy_scaler()
        self.parallel.parallelize(self)  # override points in their order (TP, PP, AC, compile, ...)
        allocate_first = meta and not self.parallel.shards_parameters  # DDP/one device: allocate, then wrap
        if allocate_first:
            self._materialize_models()
        for name, model in self.named_models():
            setattr(self, name, self.wrap_model(model))
        if meta and not allocate_first:
            self._materialize_models()  # each rank allocates its shards only

    def _setup_optimizers(self) -> None:
        """`configure_optimizers`, its optimizers and schedulers bound; none is what `fit()` will miss."""
        self._register_returned(self.configure_optimizers())  # Lightning's return forms, or None
        optimizers = self.named_optimizers()
        if not optimizers:
            self._fit_missing.append(
                f"{type(self).__name__} has no optimizer: assign one in configure_optimizers, e.g. "
                "`self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)`."
            )
        self._bind_optimizers(optimizers, self.named_schedulers())

    # --- a tuning run ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def tuning_run(self, tool: str) -> Iterator[None]:
        """Set the trainer up for training, as `fit()` does, and isolate it while the block runs: the
        trainer's own hooks fire, callbacks do not, loggers get nothing, no logging point reduces metrics,
        `max_steps` does not apply, per-step schedulers hold still. What a tool that trains through
        `training_step` (`lr_find`, `scale_batch_size`) runs inside; `tool` names it in errors. Outside a
        training epoch only."""
        loop = self._loop
        if loop.epoch_in_progress or loop.window_pos:
            raise MisconfigurationError(
                f"{tool} was called inside a training epoch (epoch {loop.epoch}, global step {loop.global_step}): "
                "call it before fit() or after it returns, not from a hook or callback of a running fit()"
            )
        self._setup_fit()
        self._require_fit_ready()  # the tool trains: it needs what fit() needs
        cadence = loop.log_every_n_steps, loop.max_steps
        with self._callbacks_muted(), self._loggers_muted(), self._schedulers_held():
            loop.set_cadence(sys.maxsize, float("inf"))  # no logging point: no reduction, nothing emitted
            try:
                yield
            finally:
                loop.set_cadence(*cadence)


def wrap_load_checkpoint(cls: type) -> None:
    """Make the `load_checkpoint` trainer class `cls` resolves to, when it is the user's (its own or a
    base class's outside the package's mixins), set the trainer up first: the Trainer Guide's override
    touches `self.optimizer` etc. Runs once, when the class is created (`DreamTrainer.__init_subclass__`)."""
    owner = next((k for k in cls.__mro__ if "load_checkpoint" in vars(k)), None)
    if owner is None or owner.__module__.startswith("dream_trainer.mixins."):
        return
    user_load = vars(owner)["load_checkpoint"]
    if not inspect.isfunction(user_load) or user_load in _SETS_UP_FIRST:
        return

    @functools.wraps(user_load)
    def load_checkpoint(self: SetupMixin, path: Any, *args: Any, **kwargs: Any) -> Any:
        self._setup_fit()
        return user_load(self, path, *args, **kwargs)

    _SETS_UP_FIRST.add(load_checkpoint)
    setattr(cls, "load_checkpoint", load_checkpoint)  # noqa: B010 - the name is the method wrapped


_SETS_UP_FIRST: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
"""The `load_checkpoint` wrappers `wrap_load_checkpoint` made (not wrapped again)."""

"""SetupMixin: discovering models/optimizers/schedulers, placing and wrapping models, and the setup
phase of `fit()`."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from dream_trainer.callbacks.bus import CallbackBus, check_hook_names
from dream_trainer.errors import MisconfigurationError
from dream_trainer.mixins.metrics import is_torchmetric
from dream_trainer.utils.data import EpochLoader, limited_length
from dream_trainer.utils.modules import has_trainable_parameters
from dream_trainer.utils.seed import seed_everything


class SetupMixin:
    """Finds what the user assigned to `self`, and runs the setup phase of `fit()`.

    Models, optimizers and schedulers are found by type among the public attributes of the trainer,
    in assignment order; there is nothing to register.
    """

    config: Any
    device: torch.device
    callbacks: Any

    def _init_setup(self) -> None:
        self._is_setup = False
        self._wrapped: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._train_loader_raw: Iterable[Any] | None = None
        self._val_loader_raw: Iterable[Any] | None = None

    # --- user-facing methods to override ---------------------------------------------------------
    def configure_models(self) -> None:
        """Build models and assign them to `self` (optional if `__init__` already did)."""

    def configure_optimizers(self) -> None:
        """Assign optimizers (and LR schedulers) to `self`. Models are already on the device."""

    def configure_dataloaders(self) -> tuple[Iterable[Any], Iterable[Any] | None]:
        """Return `(train_loader, val_loader or None)`."""
        if self._train_loader_raw is not None:
            return self._train_loader_raw, self._val_loader_raw
        raise MisconfigurationError(
            f"{type(self).__name__} has no training data: define configure_dataloaders(self) returning "
            "(train_loader, val_loader_or_None), e.g. `return DataLoader(train_ds, batch_size=32, "
            "shuffle=True), DataLoader(val_ds, batch_size=64)`."
        )

    # --- discovery --------------------------------------------------------------------------------
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

    # --- models -----------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Place `model` on `self.device`, wrap it for the strategy (DDP / FSDP2) and compile it when
        `config.compile_model`; idempotent.

        Returns the module to use in its place (the compiled wrapper, or `model` itself).
        """
        if model in self._wrapped:
            return model
        model = model.to(self.device)
        # Distribute first, then compile: PyTorch's recommended order (torch.compile(DDP(model))).
        model = self._distribute_model(model)  # type: ignore[attr-defined]
        if self.config.compile_model and has_trainable_parameters(model) and not hasattr(model, "_orig_mod"):
            model = torch.compile(model)  # type: ignore[assignment]
        self._wrapped.add(model)
        return model

    # --- data -------------------------------------------------------------------------------------
    @property
    def train_loader(self) -> EpochLoader:
        """The training loader; iterating it runs one epoch (hooks, limits, counters)."""
        if self._train_loader_raw is None:
            raise AttributeError("train_loader is set by configure_dataloaders(), which runs in fit()")
        return EpochLoader(self, self._train_loader_raw)  # type: ignore[arg-type]

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

    def _epoch_length(self) -> int | None:
        assert self._train_loader_raw is not None
        return limited_length(self._train_loader_raw, self.config.limit_train_batches, "limit_train_batches")

    def _add_default_callbacks(self) -> None:
        """Lightning's defaults, unless turned off or already attached: checkpointing, progress."""
        from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint
        from dream_trainer.callbacks.progress_base import ProgressBarBase, default_progress_bar

        if self.config.enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint(save_last=True))
        if self.config.enable_progress_bar and not any(isinstance(c, ProgressBarBase) for c in self.callbacks):
            self.callbacks.append(default_progress_bar())

    # --- the setup phase --------------------------------------------------------------------------
    def _setup_fit(self) -> None:
        """seed -> process group -> setup hook -> configure_models -> place/compile -> configure_optimizers
        -> configure_dataloaders. Runs once; `load_checkpoint` on a fresh trainer runs it too."""
        if self._is_setup:
            return
        cls = type(self)
        from dream_trainer.trainer import DreamTrainer

        check_hook_names(cls, owner="trainer")
        if cls.training_step is DreamTrainer.training_step:  # type: ignore[attr-defined]
            raise MisconfigurationError(
                f"{cls.__name__} has no training_step: define `def training_step(self, batch, batch_idx):` "
                "that computes the loss and returns it (or calls self.backward(loss)), e.g. "
                "`x, y = batch; return {'loss': F.cross_entropy(self.model(x), y)}`."
            )
        cfg = self.config
        if cfg.seed is not None:
            seed_everything(cfg.seed)
        self._init_distributed()  # type: ignore[attr-defined]
        self._add_default_callbacks()
        self._bus = CallbackBus(self, self.callbacks)  # type: ignore[arg-type]
        self._bus.fire("setup", "fit")

        self.configure_models()
        for name, model in self.named_models():
            setattr(self, name, self.wrap_model(model))

        self.configure_optimizers()
        optimizers = self.named_optimizers()
        if not optimizers:
            raise MisconfigurationError(
                f"{cls.__name__} has no optimizer: assign one in configure_optimizers, e.g. "
                "`self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)`."
            )
        self._bind_optimizers(optimizers, self.named_schedulers())  # type: ignore[attr-defined]

        loaders = self.configure_dataloaders()
        if isinstance(loaders, (tuple, list)) and len(loaders) == 2:
            train, val = loaders
        else:
            train, val = loaders, None
        if train is None:
            raise MisconfigurationError(
                f"{cls.__name__}.configure_dataloaders returned no training loader; "
                "return (train_loader, val_loader or None)."
            )
        self._train_loader_raw = self._distribute_loader(train, train=True)  # type: ignore[attr-defined]
        self._val_loader_raw = self._distribute_loader(val, train=False)  # type: ignore[attr-defined]
        if cfg.limit_val_batches == 0:
            self._val_loader_raw = None

        user_val = None
        if cls.validation_step is not DreamTrainer.validation_step:  # type: ignore[attr-defined]
            user_val = cls.validation_step.__get__(self)  # type: ignore[attr-defined]
        elif self._val_loader_raw is not None:
            raise MisconfigurationError(
                f"{cls.__name__} has a validation loader but no validation_step: define "
                "`def validation_step(self, batch, batch_idx):` returning a dict such as {'val_loss': loss}, "
                "or return None as the validation loader."
            )
        self._setup_metrics()  # type: ignore[attr-defined]
        self._sync_models = [
            m for _, m in self.named_models() if hasattr(m, "no_sync") or hasattr(m, "set_requires_gradient_sync")
        ]
        if self.is_distributed:  # type: ignore[attr-defined]
            reduce = self._reduce_sums  # type: ignore[attr-defined]
            for agg in (self._train_metrics, self._val_metrics):  # type: ignore[attr-defined]
                agg.reducer, agg.key_union = reduce, self._key_union  # type: ignore[attr-defined]
        self._install_step_wrappers(cls.training_step.__get__(self), user_val)  # type: ignore[attr-defined]
        self._epoch_len = self._epoch_length()
        self._is_setup = True

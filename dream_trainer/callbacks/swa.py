"""StochasticWeightAveraging: Lightning's SWA callback, on `torch.optim.swa_utils`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from dream_trainer.callbacks.weight_averaging import WeightAveraging, is_fsdp
from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from dream_trainer.protocol import TrainerProtocol

_STRATEGIES = ("cos", "linear")


def _has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _raw_train_loader(trainer: TrainerProtocol) -> Iterable[Any] | None:
    """The user's training loader, not the epoch-running `trainer.train_loader` wrapper around it.

    `train_loader` is not part of `TrainerProtocol` (only `val_loader` is): read it when the trainer
    has it (every `DreamTrainer` does), else None."""
    try:
        loader = getattr(trainer, "train_loader", None)
    except AttributeError:  # DreamTrainer raises before configure_dataloaders ran
        return None
    from dream_trainer.utils.data import EpochLoader

    if isinstance(loader, EpochLoader):
        return loader.loader
    return loader


class StochasticWeightAveraging(WeightAveraging[AveragedModel]):
    """Stochastic Weight Averaging (SWA, Izmailov et al. 2018), with Lightning's meaning.

    From epoch `swa_epoch_start` on, the learning rate of every optimizer follows
    `torch.optim.swa_utils.SWALR`: it anneals (`annealing_strategy`, over `annealing_epochs` epochs) from
    its value at that epoch to `swa_lrs`, then stays there. After each of those epochs the weights are
    folded into an equal-weight running average (`AveragedModel.update_parameters`). When training ends
    the average is copied into the model and, if the model has BatchNorm layers, their running statistics
    are recomputed with `update_bn` over the training loader (one pass, forward only; as `update_bn` does,
    the model is called with the batch, or its first element when the batch is a list or tuple; with
    several processes each rank passes over its own share).

    Args:
        swa_lrs: the SWA learning rate, one number for every parameter group, or one per parameter group
            of each optimizer.
        swa_epoch_start: the first SWA epoch: an epoch index (int >= 0, 0-based like `current_epoch`), or a
            fraction of `n_epochs` in (0, 1] (float: epoch `int(n_epochs * swa_epoch_start)`). Lightning
            counts from 1 here (its SWA starts at 0-based epoch `int(...) - 1`): for the same start as a
            Lightning run, pass one less, or a fraction one epoch smaller.
        annealing_epochs: epochs over which the learning rate anneals to `swa_lrs` (0: at once).
        annealing_strategy: `"cos"` or `"linear"`.
        device: where the averages live (`AveragedModel(device=...)`): `"cpu"` (Lightning's default) keeps
            them off the accelerator, and costs one copy of the weights per SWA epoch; None: the model's
            device.
        models: names of the trainer attributes to average (`"model"` or `["generator"]`). Default: every
            model in `trainer.named_models()` with trainable parameters.

    The learning rate SWA sets wins over the trainer's LR schedulers: it is set again before every
    training batch of an SWA epoch, so a scheduler stepped per step or per epoch has no effect from
    `swa_epoch_start` on (its own state keeps advancing; it is saved and restored as usual).

    `average_model(name)` is the averaged copy (an `AveragedModel`). Checkpoints carry the averages, the
    SWA schedulers and the epoch bookkeeping, so a resumed run (also mid-epoch) ends with the same
    weights as an uninterrupted one. Only parameters are averaged (`use_buffers=False`, Lightning's
    default); buffers other than BatchNorm statistics keep the model's values.
    """

    _who = "StochasticWeightAveraging"

    def __init__(
        self,
        swa_lrs: float | Sequence[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        device: str | torch.device | None = "cpu",
        models: str | Sequence[str] | None = None,
    ) -> None:
        def positive(x: Any) -> bool:
            return not isinstance(x, bool) and isinstance(x, (int, float)) and x > 0

        lrs = list(swa_lrs) if isinstance(swa_lrs, (list, tuple)) else swa_lrs
        if not (positive(lrs) or (isinstance(lrs, list) and lrs and all(positive(x) for x in lrs))):
            raise ConfigError(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}) is invalid: expected a positive number, or a "
                "non-empty list of positive numbers (one per parameter group), e.g. 0.05"
            )
        if isinstance(swa_epoch_start, bool) or not (
            (isinstance(swa_epoch_start, int) and swa_epoch_start >= 0)
            or (isinstance(swa_epoch_start, float) and 0.0 < swa_epoch_start <= 1.0)
        ):
            raise ConfigError(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start!r}) is invalid: expected an epoch "
                "index (int >= 0) or a fraction of n_epochs (float in (0, 1]), e.g. 0.8"
            )
        if isinstance(annealing_epochs, bool) or not isinstance(annealing_epochs, int) or annealing_epochs < 0:
            raise ConfigError(
                f"StochasticWeightAveraging(annealing_epochs={annealing_epochs!r}) is invalid: expected an integer >= 0"
            )
        if annealing_strategy not in _STRATEGIES:
            raise ConfigError(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}) is invalid: expected one "
                f"of {list(_STRATEGIES)}"
            )
        super().__init__(models, device)
        self.swa_lrs: float | list[float] = [float(x) for x in lrs] if isinstance(lrs, list) else float(lrs)  # type: ignore[arg-type]  # validated above
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.swa_start: int | None = None  # the resolved first SWA epoch (set when fit() starts)
        self._schedulers: dict[str, SWALR] = {}
        self._saved_schedulers: dict[str, dict[str, Any]] = {}  # from a checkpoint, applied on first use
        self._lrs: dict[str, list[float]] = {}  # the learning rates SWA set for the current epoch
        self._lr_epoch = -1  # the epoch those learning rates are for
        self._last_update_epoch = -1  # the last epoch folded into the average
        self._finalized = False  # the average was copied into the models

    # --- accessors --------------------------------------------------------------------------------
    @property
    def n_averaged(self) -> int:
        """Epochs folded into the average so far."""
        if not self._averages:
            return 0
        return int(next(iter(self._averages.values())).n_averaged.item())

    def average_model(self, name: str | None = None) -> AveragedModel:
        """The `AveragedModel` of trainer attribute `name` (may be omitted when one model is averaged);
        its `.module` is a copy of the model holding the average."""
        return self._average(name, "average_model")

    # --- creation ---------------------------------------------------------------------------------
    def _resolve_start(self, trainer: TrainerProtocol) -> int:
        if isinstance(self.swa_epoch_start, int):
            return self.swa_epoch_start
        n_epochs = trainer.config.n_epochs
        if n_epochs is None:
            raise MisconfigurationError(
                f"StochasticWeightAveraging(swa_epoch_start={self.swa_epoch_start!r}): a fraction needs "
                "config.n_epochs; give the first SWA epoch as an int instead"
            )
        return int(n_epochs * self.swa_epoch_start)

    def _new_run(self, trainer: TrainerProtocol) -> None:
        self._schedulers, self._saved_schedulers, self._lrs = {}, {}, {}
        self._lr_epoch = self._last_update_epoch = -1
        self._finalized = False
        self.swa_start = self._resolve_start(trainer)

    def _make_average(self, name: str, live: nn.Module) -> AveragedModel:
        if is_fsdp(live):
            raise MisconfigurationError(
                f"StochasticWeightAveraging: trainer.{name} is sharded by FSDP2, whose modules cannot be copied "
                "into an AveragedModel; average a model that is not sharded, or use EMA, which supports FSDP2"
            )
        avg = AveragedModel(live, device=self.device, use_buffers=False)
        for p in avg.parameters():
            p.requires_grad_(False)
        return avg

    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        super().on_fit_start(trainer)
        n_epochs = trainer.config.n_epochs
        if self.swa_start is not None and n_epochs is not None and self.swa_start >= n_epochs:
            warn_user(
                f"StochasticWeightAveraging: swa_epoch_start resolves to epoch {self.swa_start}, but n_epochs is "
                f"{n_epochs}: no weights will be averaged",
            )

    # --- learning rates ---------------------------------------------------------------------------
    def _swa_lrs_for(self, name: str, optimizer: Optimizer) -> float | list[float]:
        if isinstance(self.swa_lrs, float):
            return self.swa_lrs
        if len(self.swa_lrs) != len(optimizer.param_groups):
            raise MisconfigurationError(
                f"StochasticWeightAveraging(swa_lrs={self.swa_lrs!r}) gives {len(self.swa_lrs)} learning rates, "
                f"but optimizer {name!r} has {len(optimizer.param_groups)} parameter groups"
            )
        return list(self.swa_lrs)

    def _in_swa(self, epoch: int) -> bool:
        return self.swa_start is not None and epoch >= self.swa_start and not self._finalized

    def _advance_lrs(self, trainer: TrainerProtocol, epoch: int) -> None:
        """The SWA schedulers' learning rates for `epoch`: SWALR's first value at the first SWA epoch
        (its constructor steps once), one `step()` further at each later epoch."""
        for name, optimizer in trainer.named_optimizers():
            sched = self._schedulers.get(name)
            if sched is None:
                saved = self._saved_schedulers.pop(name, None)
                with warnings.catch_warnings():  # SWALR steps in its constructor, before any optimizer step
                    warnings.simplefilter("ignore", UserWarning)
                    sched = SWALR(
                        optimizer,
                        swa_lr=self._swa_lrs_for(name, optimizer),  # type: ignore[arg-type]  # SWALR takes a list too
                        anneal_epochs=self.annealing_epochs,
                        anneal_strategy=self.annealing_strategy,  # type: ignore[arg-type]  # validated
                    )
                self._schedulers[name] = sched
                if saved is None:  # the first SWA epoch: the constructor's step set its learning rates
                    self._lrs[name] = [g["lr"] for g in optimizer.param_groups]
                    continue
                sched.load_state_dict(saved)  # resumed: continue where the checkpoint left it
            for group, lr in zip(optimizer.param_groups, self._lrs.get(name, []), strict=False):
                group["lr"] = lr  # undo the trainer's schedulers: SWALR anneals from its own last value
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
            self._lrs[name] = [g["lr"] for g in optimizer.param_groups]
        self._lr_epoch = epoch

    def _apply_lrs(self, trainer: TrainerProtocol) -> None:
        for name, optimizer in trainer.named_optimizers():
            for group, lr in zip(optimizer.param_groups, self._lrs.get(name, ()), strict=False):
                group["lr"] = lr

    def on_train_epoch_start(self, trainer: TrainerProtocol) -> None:
        epoch = trainer.current_epoch
        if not self._in_swa(epoch):
            return
        if epoch > self._lr_epoch:  # not again when a mid-epoch resume reopens the epoch
            self._advance_lrs(trainer, epoch)
        self._apply_lrs(trainer)

    def on_train_batch_start(self, trainer: TrainerProtocol, batch: Any, batch_idx: int) -> None:
        # A scheduler stepped per step would change the learning rate after each optimizer step.
        if self._lr_epoch == trainer.current_epoch and self._in_swa(trainer.current_epoch):
            self._apply_lrs(trainer)

    # --- averaging --------------------------------------------------------------------------------
    def _maybe_update(self, epoch: int) -> None:
        if self._in_swa(epoch) and epoch > self._last_update_epoch:
            for name, avg in self._averages.items():
                avg.update_parameters(self._live[name])
            self._last_update_epoch = epoch

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        self._maybe_update(trainer.current_epoch)

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        if self._finalized or self._last_update_epoch < 0:
            return
        loader: Iterable[Any] | None = None
        with torch.no_grad():
            for name, avg in self._averages.items():
                live = self._live[name]
                for src, dst in zip(avg.module.parameters(), live.parameters(), strict=True):
                    dst.detach().copy_(src.to(dst.device))
                if _has_batch_norm(live):
                    if loader is None:
                        loader = _raw_train_loader(trainer)
                    if loader is None:
                        warn_user(
                            "StochasticWeightAveraging: the trainer has no train_loader, so the BatchNorm "
                            f"statistics of {name!r} were not recomputed for the averaged weights",
                        )
                        continue
                    update_bn(loader, live, device=trainer.device)
        self._finalized = True

    # --- checkpoints ------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        # A checkpoint written from on_train_epoch_end by a callback listed before this one must hold
        # this epoch's update, or a resumed run (which starts at the next epoch) would miss it.
        trainer = self._trainer_ref()
        if trainer is not None and trainer.loop.epoch_in_progress and trainer.loop.epoch_exhausted:
            self._maybe_update(trainer.current_epoch)
        schedulers = {n: s.state_dict() for n, s in self._schedulers.items()}
        schedulers.update(self._saved_schedulers)
        return {
            "averages": {n: avg.state_dict() for n, avg in self._averages.items()},
            "schedulers": schedulers,
            "lrs": {n: list(v) for n, v in self._lrs.items()},
            "lr_epoch": self._lr_epoch,
            "last_update_epoch": self._last_update_epoch,
            "finalized": self._finalized,
            "swa_start": self.swa_start,
        }

    def _apply_state(self, state: dict[str, Any]) -> None:
        saved = state.get("averages", {})
        self._check_saved(saved, started=state.get("last_update_epoch", -1) >= 0)
        for name, avg in self._averages.items():
            if name in saved:
                avg.load_state_dict(saved[name])
        self._schedulers = {}
        self._saved_schedulers = dict(state.get("schedulers", {}))
        self._lrs = {n: [float(x) for x in v] for n, v in state.get("lrs", {}).items()}
        self._lr_epoch = int(state.get("lr_epoch", -1))
        self._last_update_epoch = int(state.get("last_update_epoch", -1))
        self._finalized = bool(state.get("finalized", False))

"""WeightAveraging: what EMA and SWA share, averaged copies of some of the trainer's models."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.utils.modules import pick_models, unwrap

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_Average = TypeVar("_Average")


def is_fsdp(model: nn.Module) -> bool:
    """`model` (or a submodule) is sharded or replicated by FSDP2 (`fully_shard`, `replicate`): such
    modules refuse `copy.deepcopy`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


class WeightAveraging(Callback, Generic[_Average]):
    """Base of the callbacks that keep an average of some of the trainer's models (`EMA`,
    `StochasticWeightAveraging`).

    It checks the `models` and `device` arguments; makes one average per chosen model when `fit()`
    starts, or when a checkpoint is loaded first (`models=None`: every model with trainable
    parameters), and afresh when the callback is reused by another trainer; keeps a checkpoint's state
    loaded before the averages exist until they do; and finds an average by name. A subclass says how
    one average is made (`_make_average`), what else a new run resets (`_new_run`), and what its
    checkpoint state is (`_state`, `_apply_state`).
    """

    _who: ClassVar[str]
    """The name in error messages: `"EMA"`."""

    def __init__(self, models: str | Sequence[str] | None, device: str | torch.device | None) -> None:
        if isinstance(models, str):
            models = [models]
        if models is not None and (not models or not all(isinstance(m, str) for m in models)):
            raise ConfigError(
                f"{self._who}(models={models!r}) is invalid: expected None (every trainable model) or trainer "
                "attribute names such as ['model']"
            )
        try:
            resolved_device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"{self._who}(device={device!r}) is invalid: expected None (the model's device), 'cpu', 'cuda' "
                "or 'cuda:N'"
            ) from exc
        self.models = list(models) if models is not None else None
        self.device = resolved_device
        self._averages: dict[str, _Average] = {}  # model name -> its average, in the order picked
        self._live: dict[str, nn.Module] = {}  # model name -> the model (unwrapped) it averages
        self._pending_state: dict[str, Any] | None = None  # loaded before the averages existed
        self._trainer_ref: Callable[[], TrainerProtocol | None] = lambda: None

    # --- what a subclass defines ------------------------------------------------------------------
    def _make_average(self, name: str, live: nn.Module) -> _Average:
        """The average of trainer attribute `name`, the model `live` (unwrapped), as it starts."""
        raise NotImplementedError

    def _new_run(self, trainer: TrainerProtocol) -> None:
        """Before the averages of a run are made: reset what belongs to the previous run."""

    def _state(self) -> dict[str, Any]:
        """`state_dict()` once the averages exist."""
        raise NotImplementedError

    def _apply_state(self, state: dict[str, Any]) -> None:
        """`load_state_dict(state)` once the averages exist."""
        raise NotImplementedError

    # --- accessors --------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Names of the averaged models (empty before `fit()`)."""
        return list(self._averages)

    def _average(self, name: str | None, accessor: str) -> _Average:
        """The average of model `name` (None: the only one), for the public `accessor` method."""
        call = f"{self._who}.{accessor}"
        if not self._averages:
            raise RuntimeError(f"{call}(): the averages are created when fit() starts (on_fit_start)")
        if name is None:
            if len(self._averages) != 1:
                raise ValueError(f"{call}(): several models are averaged, pass one of {sorted(self._averages)}")
            name = next(iter(self._averages))
        if name not in self._averages:
            raise KeyError(f"{call}({name!r}): no average of that model; averaged: {sorted(self._averages)}")
        return self._averages[name]

    # --- creation ---------------------------------------------------------------------------------
    def _ensure_init(self, trainer: TrainerProtocol) -> None:
        if self._averages and self._trainer_ref() is trainer:
            return
        self._averages, self._live = {}, {}  # a new run (or another trainer): new averages
        self._trainer_ref = weakref.ref(trainer)
        self._new_run(trainer)
        available = dict(trainer.named_models())
        who = self._who + ("" if self.models is None else f"(models={self.models!r})")
        live = {n: unwrap(available[n]) for n in pick_models(available, self.models, who, type(trainer).__name__)}
        self._averages = {n: self._make_average(n, model) for n, model in live.items()}
        self._live = live
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._apply_state(state)

    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        self._ensure_init(trainer)

    def on_load_checkpoint(self, trainer: TrainerProtocol, checkpoint: dict[str, Any]) -> None:
        # The trainer is set up by now (models exist); load_state_dict() follows with the saved averages.
        self._ensure_init(trainer)

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self._averages and self._pending_state is not None:
            return self._pending_state
        return self._state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._averages:  # loaded before fit() built the averages: applied when they are
            self._pending_state = state_dict
            return
        self._apply_state(state_dict)

    def _check_saved(self, saved: dict[str, Any], started: bool) -> None:
        """Raise unless the checkpoint's averages `saved` cover every averaged model (when the saved run
        had `started` averaging: before that, a model without a saved average starts afresh)."""
        missing = sorted(set(self._averages) - set(saved))
        if missing and started:
            raise MisconfigurationError(
                f"{self._who}: the checkpoint has no average of {missing} (it has {sorted(saved)}); "
                "the averaged models must be the same as when it was saved"
            )

"""EMA: an exponential moving average of model weights, swapped in for validation."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dream_trainer.callbacks.weight_averaging import WeightAveraging, is_fsdp
from dream_trainer.errors import ConfigError, MisconfigurationError

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the DTensor), any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class _Shadow:
    """One model's average: a deep copy of the model, and the (live, average) tensor pairs, grouped once
    by device and dtype so an update is one fused `torch._foreach_lerp_` per group.

    A model sharded by FSDP2 cannot be deep-copied: its average is a detached clone of each parameter
    and buffer (DTensors: the same shards on the same mesh, so each rank averages only its own shards),
    with no module (`module` is None). Averaging, copying and swapping work on the local shards: the
    math is elementwise, and a fused kernel cannot take DTensors of several meshes (TP-sharded weights
    on ("dp_shard", "tp"), the rest on "dp_shard")."""

    def __init__(self, live: nn.Module, device: torch.device | None) -> None:
        self.live = live
        live_named = list(live.named_parameters()) + list(live.named_buffers())
        self.module: nn.Module | None
        if is_fsdp(live):
            if device is not None:
                raise MisconfigurationError(
                    f"EMA(device={str(device)!r}) with a model sharded by FSDP2 ({type(live).__name__}): the "
                    "averages of sharded parameters stay shards on the parameters' devices; use device=None"
                )
            self.module = None
            ema_named = [(n, t.detach().clone()) for n, t in live_named]
            self.state_keys = list(live.state_dict().keys())  # sharded (FSDP2's default): no collective
        else:
            module = copy.deepcopy(live)
            if device is not None:
                module = module.to(device)
            for p in module.parameters():
                p.requires_grad_(False)
                p.grad = None
            module.eval()
            self.module = module
            ema_named = list(module.named_parameters()) + list(module.named_buffers())
            self.state_keys = []
        if [n for n, _ in live_named] != [n for n, _ in ema_named]:  # pragma: no cover - deepcopy keeps names
            raise RuntimeError("EMA: the copy of the model does not have the model's parameters and buffers")
        self.names = [n for n, _ in live_named]
        self.live_tensors: list[torch.Tensor] = [t for _, t in live_named]
        self.ema_tensors: list[torch.Tensor] = [t for _, t in ema_named]
        # float tensors are averaged, grouped by (device, dtype) for the fused kernel; integer buffers
        # (BatchNorm's num_batches_tracked) are counters: the average keeps the live value.
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for lt, et in zip(self.live_tensors, self.ema_tensors, strict=True):
            if et.is_floating_point() or et.is_complex():
                ema_list, live_list = groups.setdefault((_local(et).device, et.dtype), ([], []))
                ema_list.append(et)
                live_list.append(lt)
            else:
                self.copied.append((et, lt))
        self.groups = list(groups.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average as the model's `state_dict()` (DTensor shards for a model sharded by FSDP2)."""
        if self.module is not None:
            return self.module.state_dict()
        ema = dict(zip(self.names, self.ema_tensors, strict=True))
        return {k: ema[k] for k in self.state_keys}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.module is not None:
            self.module.load_state_dict(state)
            return
        missing = sorted(set(self.state_keys) - set(state))
        if missing:
            raise MisconfigurationError(f"EMA: the saved average lacks {missing}")
        ema = dict(zip(self.names, self.ema_tensors, strict=True))
        for k in self.state_keys:
            ema[k].copy_(state[k])

    @torch.no_grad()
    def copy_from_live(self) -> None:
        for et, lt in zip(self.ema_tensors, self.live_tensors, strict=True):
            _local(et).copy_(_local(lt))

    @torch.no_grad()
    def update(self, weight: float) -> None:
        """`ema += weight * (live - ema)`, i.e. `ema = decay * ema + (1 - decay) * live`."""
        for ema_list, live_list in self.groups:
            # Local shards are taken on every call: FSDP2 may give a parameter a new local tensor (its
            # lazy init pads uneven shards), so a view kept from an earlier step could be stale.
            ema_list, live_list = [_local(t) for t in ema_list], [_local(t) for t in live_list]
            device = ema_list[0].device
            if live_list[0].device != device:  # EMA kept on another device (e.g. CPU offload)
                live_list = [t.to(device) for t in live_list]
            torch._foreach_lerp_(ema_list, live_list, weight)
        for et, lt in self.copied:
            _local(et).copy_(_local(lt))

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the values of the live tensors and the average, one tensor at a time (so the extra
        memory is one tensor, not one model). Bit-exact: doing it twice restores both."""
        for lt, et in zip(self.live_tensors, self.ema_tensors, strict=True):
            lt, et = _local(lt), _local(et)
            tmp = lt.detach().clone()
            lt.copy_(et)
            et.copy_(tmp)


class EMA(WeightAveraging[_Shadow]):
    """Keep an exponential moving average (EMA) of model weights; validate with it.

    After each training step (every `update_every_n_steps` steps, from `global_step >= start_step` on)
    every averaged parameter and floating-point buffer becomes `decay * ema + (1 - decay) * weight`.
    The first update copies the weights (as `torch.optim.swa_utils.AveragedModel` does), so the average
    starts from the weights at `start_step` rather than from the initialization.

    Args:
        decay: weight of the old average in each update, in [0, 1] (0.9999 is common for long runs).
        update_every_n_steps: update after every n-th training step (`global_step % n == 0`); the decay
            applies per update.
        start_step: no update before `global_step` reaches this; the first update copies the weights.
        models: names of the trainer attributes to average (`"model"` or `["generator"]`). Default: every
            model in `trainer.named_models()` with trainable parameters.
        swap_for_validation: during every validation run (sanity check included, once an update has
            happened) the live models hold the EMA weights; the training weights are put back at
            `on_validation_end`, bit for bit (also when validation raises).
        device: where the averages live (e.g. `"cpu"` to save accelerator memory; each update then copies
            the weights to it). Default: the model's device.

    `ema_model(name)` is the averaged copy of a model (the user's own class, in eval mode) and
    `ema_state_dict()` its weights, ready for `model.load_state_dict`. Checkpoints carry the averages
    and the update count, so a resumed run continues the average exactly.

    Why not `AveragedModel.update_parameters`: it reads its `n_averaged` counter (`bool(n_averaged == 0)`
    on the EMA's device, or a blocking host-to-device copy of it when the counter is on the CPU) and
    regroups every tensor on each call, so each update would synchronize the accelerator. The update
    here is the same math as `get_ema_multi_avg_fn` (`torch._foreach_lerp_` with weight `1 - decay`,
    buffers averaged as with `use_buffers=True`) over tensor lists grouped once, with a Python counter:
    no sync, one fused kernel per (device, dtype) group per update.
    """

    _who = "EMA"

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        start_step: int = 0,
        models: str | Sequence[str] | None = None,
        swap_for_validation: bool = True,
        device: str | torch.device | None = None,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ConfigError(f"EMA(decay={decay!r}) is invalid: expected a number in [0, 1], e.g. 0.999")
        if (
            isinstance(update_every_n_steps, bool)
            or not isinstance(update_every_n_steps, int)
            or update_every_n_steps < 1
        ):
            raise ConfigError(
                f"EMA(update_every_n_steps={update_every_n_steps!r}) is invalid: expected a positive integer"
            )
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ConfigError(f"EMA(start_step={start_step!r}) is invalid: expected an integer >= 0")
        super().__init__(models, device)
        self.decay = float(decay)
        self.update_every_n_steps = update_every_n_steps
        self.start_step = start_step
        self.swap_for_validation = swap_for_validation
        self.num_updates = 0  # updates so far (0: the average is not started yet)
        self._last_update_step = -1
        self._last_seen_step = -1
        self._swapped = False

    # --- accessors --------------------------------------------------------------------------------
    def ema_model(self, name: str | None = None) -> nn.Module:
        """The averaged copy of trainer attribute `name` (may be omitted when one model is averaged)."""
        module = self._average(name, "ema_model").module
        if module is None:
            raise MisconfigurationError(
                f"EMA.ema_model({name!r}): the model is sharded by FSDP2, whose modules cannot be copied, so "
                "its average is kept as shards without a module: use ema_state_dict() (loadable into the "
                "model) or validate with swap_for_validation=True"
            )
        return module

    def ema_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """`{model name: state_dict of its average}`, loadable into the model (`model.load_state_dict`)."""
        return {name: self._ema_weights(name) for name in self._averages}

    def _ema_weights(self, name: str) -> dict[str, torch.Tensor]:
        shadow = self._averages[name]
        sd = shadow.state_dict()
        if self._swapped:  # during validation the average lives in the model itself
            live = dict(zip(shadow.names, shadow.live_tensors, strict=True))
            sd = {k: live[k].detach().clone() if k in live else v for k, v in sd.items()}
        return sd

    # --- creation ---------------------------------------------------------------------------------
    def _new_run(self, trainer: TrainerProtocol) -> None:
        self.num_updates = 0
        self._last_update_step = self._last_seen_step = -1
        self._swapped = False

    def _make_average(self, name: str, live: nn.Module) -> _Shadow:
        return _Shadow(live, self.device)

    # --- updates ----------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.loop.step_ended:  # a training step (accumulation window) just completed
            self._maybe_update(trainer.global_step)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        # A loader without a length can end inside an accumulation window; the trainer then closes the
        # window at the epoch end without an on_train_batch_end.
        self._maybe_update(trainer.global_step)

    def _maybe_update(self, step: int) -> None:
        if step <= 0 or step == self._last_seen_step:  # step 0: no training step has completed yet
            return
        self._last_seen_step = step
        if step < self.start_step or step % self.update_every_n_steps or step == self._last_update_step:
            return
        self.update_now()
        self._last_update_step = step

    def update_now(self) -> None:
        """Fold the current weights into the averages (the first call copies them)."""
        if not self._averages:
            raise RuntimeError("EMA.update_now(): the averages are created when fit() starts (on_fit_start)")
        if self._swapped:
            raise RuntimeError("EMA.update_now(): cannot update during validation, the EMA weights are swapped in")
        for shadow in self._averages.values():
            if self.num_updates == 0:
                shadow.copy_from_live()
            else:
                shadow.update(1.0 - self.decay)
        self.num_updates += 1

    # --- validation -------------------------------------------------------------------------------
    def on_validation_start(self, trainer: TrainerProtocol) -> None:
        # Before the first update the average would be the weights themselves: nothing to swap.
        if self.swap_for_validation and self.num_updates > 0 and not self._swapped:
            self._swap()

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        if self._swapped:
            self._swap()

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        if self._swapped:  # validation failed half-way: the model gets its training weights back
            self._swap()

    def _swap(self) -> None:
        for shadow in self._averages.values():
            shadow.swap()
        self._swapped = not self._swapped

    # --- checkpoints ------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: TrainerProtocol, checkpoint: dict[str, Any]) -> None:
        if not self._swapped:
            return
        # Saved during validation: the models hold the EMA weights, the training weights are in the
        # averages' tensors. The checkpoint must get the training weights.
        models = checkpoint.get("models", {})
        for name, shadow in self._averages.items():
            if name in models:
                held = dict(zip(shadow.names, shadow.ema_tensors, strict=True))
                models[name] = {
                    k: held[k].detach().clone().to(v.device) if k in held else v for k, v in models[name].items()
                }

    def _state(self) -> dict[str, Any]:
        # A checkpoint written from on_train_batch_end by a callback listed before this one must still
        # hold this step's update, or a resumed run would miss it: fold it in now (once per step).
        trainer = self._trainer_ref()
        if trainer is not None and trainer.loop.step_ended and not self._swapped:
            self._maybe_update(trainer.global_step)
        return {
            "models": {name: self._ema_weights(name) for name in self._averages},
            "num_updates": self.num_updates,
            "last_update_step": self._last_update_step,
            "last_seen_step": self._last_seen_step,
            "decay": self.decay,
        }

    def _apply_state(self, state: dict[str, Any]) -> None:
        if self._swapped:
            raise RuntimeError("EMA.load_state_dict(): cannot load during validation")
        saved = state.get("models", {})
        self._check_saved(saved, started=bool(state.get("num_updates", 0)))
        for name, shadow in self._averages.items():
            if name in saved:
                shadow.load_state_dict(saved[name])
        self.num_updates = int(state.get("num_updates", 0))
        self._last_update_step = int(state.get("last_update_step", -1))
        self._last_seen_step = int(state.get("last_seen_step", -1))

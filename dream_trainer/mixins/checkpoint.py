"""CheckpointMixin: the trainer's whole state as one dict, and files that hold it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.data_resume import has_own_state
from dream_trainer.utils.modules import unwrap
from dream_trainer.utils.seed import rng_state, set_rng_state

FORMAT_VERSION = 1


class CheckpointMixin:
    """`state_dict()` / `load_state_dict()` and `save_checkpoint(path)` / `load_checkpoint(path)`.

    The state holds models (unwrapped), optimizers, schedulers, the loss scaler, counters, RNG states
    and callback states. Files are written atomically (temporary name, fsync, rename) and read with
    `torch.load(weights_only=True)`, so loading never unpickles arbitrary objects. Both file methods
    may be overridden (seed 004 does).
    """

    config: Any
    global_step: int
    current_epoch: int
    grad_scaler: torch.amp.GradScaler | None
    callbacks: Any
    _bus: Any

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run; fires `on_save_checkpoint(checkpoint)`."""
        self._setup_fit()  # type: ignore[attr-defined]
        state: dict[str, Any] = {
            "dream_trainer": {
                "format_version": FORMAT_VERSION,
                "trainer_class": type(self).__qualname__,
                "config": self.config.to_dict(),
            },
            "models": {n: unwrap(m).state_dict() for n, m in self.named_models()},  # type: ignore[attr-defined]
            "optimizers": {n: o.state_dict() for n, o in self.named_optimizers()},  # type: ignore[attr-defined]
            "schedulers": {n: s.state_dict() for n, s in self.named_schedulers()},  # type: ignore[attr-defined]
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "counters": self._counters_state(),
            "data": self._data_state(),
            "window": self._window_state(),
            "rng": rng_state(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
        }
        for fn in self._bus.on_save_checkpoint:
            fn(state)
        return state

    def _counters_state(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "current_epoch": self.current_epoch,
            # The epoch a resumed run starts in: the next one once this epoch's batches are all done
            # (a checkpoint written from on_train_epoch_end must not replay the epoch).
            "resume_epoch": self.current_epoch + int(self._epoch_in_progress and self._epoch_exhausted),  # type: ignore[attr-defined]
            "non_finite_counts": dict(self.non_finite_counts),  # type: ignore[attr-defined]
            "last_val_step": self._last_val_step,  # type: ignore[attr-defined]
        }

    def _data_state(self) -> dict[str, Any]:
        """Where in the epoch the run is: enough to resume on the next batch it would have seen."""
        loader = self._train_loader_raw  # type: ignore[attr-defined]
        mid_epoch = self._epoch_in_progress and not self._epoch_exhausted  # type: ignore[attr-defined]
        return {
            "epoch": self.current_epoch,
            "batches_done": self._batches_done if mid_epoch else 0,  # type: ignore[attr-defined]
            "epoch_rng": self._epoch_rng if mid_epoch else None,  # type: ignore[attr-defined]
            "loader_state": loader.state_dict() if mid_epoch and has_own_state(loader) else None,
        }

    def _window_state(self) -> dict[str, Any] | None:
        """A checkpoint inside an accumulation window keeps the gradients accumulated so far."""
        if not self._window_pos:  # type: ignore[attr-defined]
            return None
        grads = {
            name: {pn: p.grad.detach().cpu() for pn, p in unwrap(m).named_parameters() if p.grad is not None}
            for name, m in self.named_models()  # type: ignore[attr-defined]
        }
        return {
            "pos": self._window_pos,  # type: ignore[attr-defined]
            "size": self._window_size,  # type: ignore[attr-defined]
            "manual_step": self._manual_step,  # type: ignore[attr-defined]
            "backward": self._window_backward,  # type: ignore[attr-defined]
            "grads": grads,
        }

    def _restore_window(self, window: dict[str, Any] | None) -> None:
        if window is None:
            return
        self._window_pos = window["pos"]
        self._window_size = self._loss_divisor = window["size"]
        self._manual_step = window["manual_step"]
        self._window_backward = window["backward"]
        self._stepped_in_window = False
        self._scaler_unscaled = False
        for name, model in self.named_models():  # type: ignore[attr-defined]
            saved = window["grads"].get(name, {})
            for pn, p in unwrap(model).named_parameters():
                p.grad = saved[pn].to(p.device) if pn in saved else None

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what `state_dict()` returned; sets the trainer up first if `fit()` has not.

        With `strict=False`, models load with `strict=False` and missing entries are skipped.
        """
        self._setup_fit()  # type: ignore[attr-defined]
        if not isinstance(state, dict) or "models" not in state:
            raise CheckpointError(
                "this is not a dream_trainer checkpoint (no 'models' entry); it has keys "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}"
            )
        for fn in self._bus.on_load_checkpoint:
            fn(state)
        self._load_group("models", state, dict(self.named_models()), strict)  # type: ignore[attr-defined]
        self._load_group("optimizers", state, dict(self.named_optimizers()), strict)  # type: ignore[attr-defined]
        self._load_group("schedulers", state, dict(self.named_schedulers()), strict)  # type: ignore[attr-defined]
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        counters = state.get("counters", {})
        self.global_step = int(counters.get("global_step", 0))
        self.current_epoch = int(counters.get("resume_epoch", counters.get("current_epoch", 0)))
        self.non_finite_counts.update(counters.get("non_finite_counts", {}))  # type: ignore[attr-defined]
        self._last_val_step = int(counters.get("last_val_step", -1))
        data = state.get("data") or {}
        self._pending_resume = None
        if data.get("batches_done", 0) > 0 and data.get("epoch") == self.current_epoch:
            # Applied when the loop opens this epoch's iterator (see DreamTrainer._iter_train_batches).
            self._pending_resume = {**data, "rng": state["rng"], "window": state.get("window")}
        if "rng" in state:
            set_rng_state(state["rng"])
        saved = state.get("callbacks", {})
        for cb in self.callbacks:
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])

    def _load_group(self, group: str, state: dict[str, Any], live: dict[str, Any], strict: bool) -> None:
        saved = state.get(group, {})
        missing = sorted(set(live) - set(saved))
        if missing and strict:
            raise CheckpointError(
                f"the checkpoint has no {group} named {missing} (it has {sorted(saved)}); "
                "pass strict=False to load the rest."
            )
        for name, obj in live.items():
            if name not in saved:
                continue
            try:
                if group == "models":
                    unwrap(obj).load_state_dict(saved[name], strict=strict)
                else:
                    obj.load_state_dict(saved[name])
            except (RuntimeError, ValueError, KeyError) as exc:
                hint = " Pass strict=False to load matching entries only." if group == "models" else ""
                raise CheckpointError(f"cannot load {group[:-1]} {name!r}: {exc}.{hint}") from exc

    # --- files ------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write `state_dict()` to `path` atomically (only global rank zero writes). Returns the path."""
        path = Path(path)
        state = self.state_dict()
        if self.is_global_zero:  # type: ignore[attr-defined]
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if tmp.exists():
                    tmp.unlink()
        return path

    def load_checkpoint(self, path: str | os.PathLike[str], strict: bool = True) -> None:
        """Read a checkpoint written by `save_checkpoint` and restore it (sets the trainer up first)."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"no checkpoint file at {str(path)!r}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # weights_only refused an object: the file holds something other than plain state.
            raise CheckpointError(
                f"refused to load {str(path)!r}: it contains objects that are not plain tensors/containers "
                f"and loading them could run code ({exc})"
            ) from exc
        except Exception as exc:  # torch's readers raise many types for torn or foreign files
            raise CheckpointError(
                f"cannot read checkpoint {str(path)!r}: it is truncated or not a checkpoint ({exc!r})"
            ) from exc
        self.load_state_dict(state, strict=strict)

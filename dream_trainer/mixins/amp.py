"""AMPMixin: the precision policy: the autocast dtype and context, and the fp16 loss scaler.

`backward` (which scales the loss with this scaler) lives in `OptimizationMixin`, with the
accumulation window whose state it reads and writes; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any

import torch

from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.run_state import StateOwner

_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


class AMPMixin(DistributedMixin):
    """Mixed precision the PyTorch way: `torch.autocast` and one `torch.amp.GradScaler`.

    One scaler serves every optimizer (PyTorch's recipe for several models and losses): each
    optimizer is unscaled and stepped through it, and it is updated once per training step.
    """

    def _init_precision(self) -> None:
        self._amp_dtype: torch.dtype | None = _DTYPES[self.config.mixed_precision]
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.grad_scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(self.device.type) if self.config.mixed_precision == "fp16" else None
        )
        self._state_owners.register(
            "grad_scaler", StateOwner(self._scaler_state, self._load_scaler_state, self._copy_scaler, self._put_scaler)
        )

    def _use_strategy_scaler(self) -> None:
        """At setup, before the models are parallelized: the scaler the strategy needs (a mesh
        strategy's `MeshGradScaler` in place of the fp16 `GradScaler`), decided by the strategy."""
        self.grad_scaler = self.parallel.scaler_for(self.grad_scaler)

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def _scaler_state(self) -> dict[str, Any]:
        return {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def _load_scaler_state(self, checkpoint: Mapping[str, Any]) -> None:
        if self.grad_scaler is not None and checkpoint.get("grad_scaler"):
            self.grad_scaler.load_state_dict(checkpoint["grad_scaler"])

    def _copy_scaler(self) -> torch.amp.GradScaler | None:
        # The whole object: a scaler that never scaled has no state_dict to load back.
        return copy.deepcopy(self.grad_scaler)

    def _put_scaler(self, saved: torch.amp.GradScaler | None) -> None:
        self.grad_scaler = copy.deepcopy(saved)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of `config.mixed_precision` (a no-op context in fp32).

        `training_step` and `validation_step` already run inside it; nesting it is harmless.
        """
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._amp_dtype)

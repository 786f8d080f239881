"""AMPMixin: the precision policy: the autocast dtype and context, and the fp16 loss scaler.

`backward` (which scales the loss with this scaler) lives in `OptimizationMixin`, with the
accumulation window whose state it reads and writes; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dream_trainer.mixins.distributed import DistributedMixin

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

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of `config.mixed_precision` (a no-op context in fp32).

        `training_step` and `validation_step` already run inside it; nesting it is harmless.
        """
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._amp_dtype)

"""AMPMixin: autocast contexts, the fp16 loss scaler, and `backward`."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


class AMPMixin:
    """Mixed precision the PyTorch way: `torch.autocast` and one `torch.amp.GradScaler`.

    One scaler serves every optimizer (PyTorch's recipe for several models and losses): each
    optimizer is unscaled and stepped through it, and it is updated once per training step.
    """

    config: Any
    device: torch.device
    _bus: Any

    def _init_precision(self) -> None:
        self._amp_dtype: torch.dtype | None = _DTYPES[self.config.mixed_precision]
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
        self.grad_scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(self.device.type) if self.config.mixed_precision == "fp16" else None
        )
        self._loss_divisor: int = 1
        self._sync_models: list[Any] = []  # DDP/FSDP models, set at setup
        self._backward_in_step = False
        self._window_backward = False

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of `config.mixed_precision` (a no-op context in fp32).

        `training_step` and `validation_step` already run inside it; nesting it is harmless.
        """
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._amp_dtype)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss`: averaged over the accumulation window, scaled under fp16.

        Fires `on_before_backward(loss)` and `on_after_backward()`. Extra keyword arguments
        (`retain_graph=True`, ...) go to `torch.Tensor.backward`.
        """
        for fn in self._bus.on_before_backward:
            fn(loss)
        if self._loss_divisor != 1:
            loss = loss / self._loss_divisor
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        if self._sync_models and not self._window_end:  # type: ignore[attr-defined]
            # Inside an accumulation window: no gradient all-reduce until its last micro-batch.
            with self._no_sync(self._sync_models):  # type: ignore[attr-defined]
                loss.backward(**kwargs)
        else:
            loss.backward(**kwargs)
        self._backward_in_step = True
        self._window_backward = True
        for fn in self._bus.on_after_backward:
            fn()

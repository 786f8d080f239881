"""Reading what a training step and an `on_train_batch_start` hook return."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss a `training_step` returned: the tensor itself, or a dict's `"loss"` tensor; else None."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def ends_epoch(returned: Any) -> bool:
    """Whether an `on_train_batch_start` return value is Lightning's -1 ("skip the rest of the epoch").
    Only called for a hook that returned something other than None."""
    if isinstance(returned, torch.Tensor):
        return returned.numel() == 1 and bool(returned == -1)
    return isinstance(returned, int) and not isinstance(returned, bool) and returned == -1

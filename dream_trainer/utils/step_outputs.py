"""Reading what a training step, an evaluation step and an `on_train_batch_start` hook return."""

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


def nothing_logged_note(owner: str, step: str, last: Any) -> str:
    """The warning for an evaluation that ran batches and logged nothing; `last`: what `step` returned
    on its last batch (None, or something that is not a dict of metrics)."""
    metric = "val_loss" if step == "validation_step" else f"{step.split('_')[0]}_loss"
    if last is None:
        returned = "None"
    elif isinstance(last, Mapping):
        returned = "a dict without a scalar entry"
    else:
        returned = f"a {type(last).__name__}, which is not logged"
    return (
        f"{owner}.{step} returned {returned}, and self.log recorded nothing: no metric is logged from "
        f"{step.split('_')[0]}. Return a dict such as {{'{metric}': loss}}, or call self.log('{metric}', loss) "
        "in the step. (Said once; ignore it if you log these results another way.)"
    )

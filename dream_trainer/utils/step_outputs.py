"""Reading what a training step, an evaluation step and an `on_train_batch_start` hook return."""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping
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


def _loss_attribute(outputs: Any) -> torch.Tensor | None:
    """A scalar tensor `outputs.loss` (a Hugging Face `ModelOutput`, a dataclass of outputs); else None."""
    loss = getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class EvalMetricNames:
    """The metric names of what an evaluation step (`validation_step`, `test_step`) returns, for one
    evaluation run of `phase` ("val" or "test"): a validation value never takes a training metric's name.

    - The loss (a scalar tensor returned as it is, a mapping's `"loss"`, a `ModelOutput`'s `loss`) is
      `<phase>_loss`: `val_loss`, `test_loss`.
    - Any other entry named like a training metric (`training`: the names training has logged) is
      `<phase>_<name>`; the others keep their names (`{"val_loss": ...}`, `{"acc": ...}`).
    - A name the step also gave explicitly, as a key of the same mapping or with `self.log` in this run
      (`explicit`, read as it grows), keeps the explicit value: the derived one is dropped.

    Non-scalar entries are passed on as they are (the aggregator ignores them). The names are decided
    once per key and run; a mapping that needs no new name is passed on as it is."""

    def __init__(self, phase: str, training: Collection[str], explicit: Container[str]) -> None:
        self.phase = phase
        self.loss_name = f"{phase}_loss"
        self.training = frozenset(training)
        self._explicit = explicit
        self._names: dict[Any, Any] = {}

    def name(self, key: Any) -> Any:
        """The metric name of a returned mapping's `key`."""
        name = self._names.get(key)
        if name is None:
            if key == "loss":
                name = self.loss_name
            elif isinstance(key, str) and key in self.training:
                name = f"{self.phase}_{key}"
            else:
                name = key
            self._names[key] = name
        return name

    def metrics(self, outputs: Any) -> Mapping[Any, Any] | None:
        """What the step returned, as the phase's metrics by name; None when it holds none."""
        if isinstance(outputs, torch.Tensor):
            if outputs.numel() != 1 or self.loss_name in self._explicit:
                return None
            return {self.loss_name: outputs}
        if not isinstance(outputs, Mapping):
            loss = _loss_attribute(outputs)  # an output object that is not a mapping
            return None if loss is None or self.loss_name in self._explicit else {self.loss_name: loss}
        # A ModelOutput-like mapping may hold its loss as an attribute only (a plain dict has no attributes).
        extra = None if type(outputs) is dict or "loss" in outputs else _loss_attribute(outputs)
        if extra is None and all(self.name(key) == key for key in outputs):
            return outputs
        named: dict[Any, Any] = {}
        for key, value in outputs.items():
            name = self.name(key)
            if name == key or (name not in outputs and name not in self._explicit):
                named[name] = value
        if extra is not None and self.loss_name not in outputs and self.loss_name not in self._explicit:
            named[self.loss_name] = extra
        return named


def ends_epoch(returned: Any) -> bool:
    """Whether an `on_train_batch_start` return value is Lightning's -1 ("skip the rest of the epoch").
    Only called for a hook that returned something other than None."""
    if isinstance(returned, torch.Tensor):
        return returned.numel() == 1 and bool(returned == -1)
    return isinstance(returned, int) and not isinstance(returned, bool) and returned == -1


def nothing_logged_note(owner: str, step: str, last: Any) -> str:
    """The warning for an evaluation that ran batches and logged nothing; `last`: what `step` returned
    on its last batch (None, or something that holds no scalar metric)."""
    stage = step.split("_")[0]
    metric = "val_loss" if step == "validation_step" else f"{stage}_loss"
    if last is None:
        returned = "None"
    elif isinstance(last, torch.Tensor):
        returned = f"a tensor of shape {tuple(last.shape)}, which is not a scalar"
    elif isinstance(last, Mapping):
        returned = "a dict without a scalar entry"
    else:
        returned = f"a {type(last).__name__}, which is not logged"
    return (
        f"{owner}.{step} returned {returned}, and self.log recorded nothing: no metric is logged from "
        f"{stage}. Return the loss (logged as '{metric}') or a dict such as {{'{metric}': loss}}, or call "
        f"self.log('{metric}', loss) in the step. (Said once; ignore it if you log these results another way.)"
    )


def name_clash_note(owner: str, clashes: Mapping[str, str]) -> str:
    """The warning for metric names an evaluation logged that training logs too; `clashes`: each name and the
    phase that logged it ("val" or "test")."""
    listed = ", ".join(f"'{name}'" for name in clashes)
    renamed = ", ".join(f"'{phase}_{name}'" for name, phase in clashes.items())
    steps = sorted({"validation_step" if phase == "val" else f"{phase}_step" for phase in clashes.values()})
    verb = "is" if len(clashes) == 1 else "are"
    return (
        f"{owner}: {listed} {verb} logged by training and by {' and '.join(steps)}, so trainer.callback_metrics, "
        f"the loggers and a monitor of that name get the two mixed. Name the evaluation's {renamed} "
        "(with self.log, or as a returned key); a value the step returns under a training metric's name is "
        "renamed so once training has logged that name. (Said once per name.)"
    )

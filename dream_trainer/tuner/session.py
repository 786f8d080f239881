"""A tuning session: training steps run through the trainer's own step, then everything put back.

The tuners (`lr_find`, `scale_batch_size`) call `trainer.training_step`, the full step of `fit()`, so
accumulation, mixed precision, clipping and the non-finite policies are the trainer's own. While a
session lasts, nothing leaves the trainer: callbacks do not fire (the trainer's own hooks still do),
loggers get nothing, no metrics are reduced, no run directory is claimed, and per-step schedulers are
held still (the tuner sets the learning rate): the trainer's `tuning_run()`. When it ends,
`TrainerSnapshot.restore()` puts back the weights, gradients, optimizer and scheduler state, and the
trainer's own run state (the registry of `dream_trainer.run_state`: the loop, the loss scaler, the RNG,
accumulated metrics, ...), so `fit()` afterwards is the run it would have been.

The snapshot lives in memory (a copy of the weights and optimizer state), not in a file. It uses the
trainer's public API only: state the trainer adds is in its registry, so the snapshot follows.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.trainer import DreamTrainer
from dream_trainer.utils.modules import unwrap


class TrainerSnapshot:
    """What a tuning run changes, captured once and restorable any number of times (the batch-size
    finder starts every trial from it)."""

    def __init__(self, trainer: DreamTrainer) -> None:
        self.trainer = trainer
        models = [unwrap(m) for _, m in trainer.named_models()]
        self._weights = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
        self._modes = [(module, module.training) for m in models for module in m.modules()]
        self._grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in _parameters(models)]
        self._optimizers = [(o, copy.deepcopy(o.state_dict())) for _, o in trainer.named_optimizers()]
        self._schedulers = [(s, copy.deepcopy(s.state_dict())) for _, s in trainer.named_schedulers()]
        self._should_stop = trainer.should_stop
        self._run_state = trainer.state_owners.snapshot()  # everything else the trainer owns

    def restore(self) -> None:
        """Put everything captured back (copies: the snapshot stays valid for the next restore)."""
        t = self.trainer
        with torch.no_grad():
            for (_, model), weights in zip(t.named_models(), self._weights, strict=True):
                unwrap(model).load_state_dict(weights)  # copies in place: the optimizers keep their parameters
        for module, mode in self._modes:
            module.training = mode
        for param, grad in self._grads:
            param.grad = None if grad is None else grad.clone()
        for opt, opt_state in self._optimizers:
            # load_state_dict keeps tensors it need not cast: hand it a copy, never the snapshot itself.
            opt.load_state_dict(copy.deepcopy(opt_state))
        for sched, sched_state in self._schedulers:
            sched.load_state_dict(copy.deepcopy(sched_state))
        t.should_stop = self._should_stop
        t.state_owners.restore(self._run_state)


def _parameters(models: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in models:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


@contextlib.contextmanager
def tuning_session(trainer: DreamTrainer, tool: str) -> Iterator[TrainerSnapshot]:
    """Set the trainer up and isolate it (`trainer.tuning_run`, see the module docstring), and snapshot
    it; on exit, however it exits, restore the snapshot and undo the isolation. `tool` names the caller
    in errors."""
    if not isinstance(trainer, DreamTrainer):
        raise TypeError(f"{tool} needs a DreamTrainer; got {type(trainer).__name__}")
    with trainer.tuning_run(tool):
        snapshot = TrainerSnapshot(trainer)
        for _, model in trainer.named_models():
            model.train()
        try:
            yield snapshot
        finally:
            snapshot.restore()


def cycle_batches(trainer: DreamTrainer) -> Iterator[tuple[int, Any]]:
    """`(batch_idx, batch)` of the training loader, `limit_train_batches` applied, starting over at
    the end of each pass (a short loader still gives a tuner as many steps as it asks for)."""
    loader = trainer.train_loader.loader  # set up by tuning_run
    length = trainer.loop.epoch_length
    while True:
        produced = False
        for batch_idx, batch in enumerate(loader):
            if length is not None and batch_idx >= length:
                break
            produced = True
            yield batch_idx, batch
        if not produced:
            raise MisconfigurationError("the training loader yielded no batch: the tuner has nothing to train on")


def loss_of(outputs: Any, tool: str, trainer: DreamTrainer) -> torch.Tensor:
    """The loss `training_step` returned; an error naming what to return when there is none."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach()
    raise MisconfigurationError(
        f"{tool} reads the loss from what {type(trainer).__name__}.training_step returns, and it returned "
        f"{type(outputs).__name__}: return the loss (a scalar tensor, or a dict with it under 'loss'), also when "
        "the step calls self.backward itself"
    )

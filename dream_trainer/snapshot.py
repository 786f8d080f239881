"""`RunSnapshot`: what `trainer.snapshot()` returns and `trainer.restore(snapshot)` puts back, the whole run state
in memory.

A snapshot is what a checkpoint holds, as it is in this process and without a file: the user's objects
the checkpoint saves by attribute name (models' weights and train/eval modes, their gradients, the
optimizers, the LR schedulers, `should_stop`) copied here, and everything else through the same registry
of state owners a checkpoint iterates (`dream_trainer.run_state`: the loop's counters and position, the
loss scaler, the RNG, accumulated metrics, the non-finite counts, the spike detector's history, the
datamodule's and the callbacks' state). State registered there is in the snapshot without another change.

Users of it: the tuner (`dream_trainer.tuner.session`, every trial starts from one snapshot) and the
spike rollback (`dream_trainer.bad_batches.BadBatchPolicy`, given `snapshot` and `restore` by the trainer).
A snapshot does not rewind a data iterator: batches already fetched are not fetched again (the rollback
replays the ones it kept). It holds copies on the device the state lives on (one more copy of the weights
and optimizer state: size it like a checkpoint). `StateDictMixin` (`dream_trainer.mixins.state_dict`), which
builds a checkpoint's state, has the two methods: a snapshot is that state without a file.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from dream_trainer.utils.modules import unwrap

if TYPE_CHECKING:
    from dream_trainer.mixins.state_dict import StateDictMixin


class RunSnapshot:
    """The run state at one moment (`trainer.snapshot()`); `trainer.restore(snapshot)` puts it back, any
    number of times (every restore copies out of it). Opaque: read `global_step` and `epoch` only."""

    __slots__ = ("_grads", "_modes", "_optimizers", "_run_state", "_schedulers", "_should_stop", "_weights", "epoch",
                 "global_step", "trainer_id")  # fmt: skip

    def __init__(self, trainer: StateDictMixin) -> None:
        self.trainer_id = id(trainer)
        self.global_step = trainer._loop.global_step
        self.epoch = trainer._loop.epoch
        models = [unwrap(m) for _, m in trainer.named_models()]
        self._weights = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
        self._modes = [(module, module.training) for m in models for module in m.modules()]
        self._grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in _parameters(models)]
        self._optimizers = [(o, copy.deepcopy(o.state_dict())) for _, o in trainer.named_optimizers()]
        self._schedulers = [(s, copy.deepcopy(s.state_dict())) for _, s in trainer.named_schedulers()]
        self._should_stop = trainer.should_stop
        self._run_state = trainer.state_owners.snapshot()  # everything else the trainer owns

    def _put_back(self, trainer: StateDictMixin) -> None:
        with torch.no_grad():
            for (_, model), weights in zip(trainer.named_models(), self._weights, strict=True):
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
        trainer.should_stop = self._should_stop
        trainer.state_owners.restore(self._run_state)


def _parameters(models: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in models:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())

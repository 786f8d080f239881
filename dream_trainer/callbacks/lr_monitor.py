"""LearningRateMonitor: log each optimizer's learning rate (and optionally momentum / weight decay)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from dream_trainer.protocol import TrainerProtocol

_INTERVALS = (None, "step", "epoch")


class LearningRateMonitor(Callback):
    """Log the learning rate of every optimizer through `trainer.log_metrics`.

    Args:
        logging_interval: `"step"`: every `config.log_every_n_steps` training steps, with the rates
            the next step will use, logged at that step (so `lr-optimizer` at step `k` is the rate of
            step `k`, next to the training metrics flushed at `k`); the rates before the first step
            are logged at step 0. `"epoch"`: at the start of every epoch. `None` (default): optimizers
            with an LR scheduler follow its interval (`trainer.scheduler_interval`: a returned
            scheduler dict's `"interval"`, else `config.scheduler_interval`), the others are logged
            per step (Lightning's rule).
        log_momentum: also log `<key>-momentum` (`momentum`, or `betas[0]` for Adam-like optimizers;
            0 when an optimizer has neither).
        log_weight_decay: also log `<key>-weight_decay`.

    Keys are `lr-<optimizer attribute name>` (e.g. `lr-optimizer`); an optimizer with several param
    groups gets one key per group, `lr-<name>/<group name>` when the group has a `"name"` entry, else
    `lr-<name>/pg1`, `lr-<name>/pg2`, ... (1-based, as in Lightning). Values also appear in
    `trainer.callback_metrics`; `lrs` keeps every learning rate logged, per key.

    Reading a rate is a Python dict lookup: nothing happens on steps that do not log.
    """

    def __init__(
        self,
        logging_interval: str | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in _INTERVALS:
            raise ConfigError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}) is invalid: "
                "valid choices are None, 'step', 'epoch'"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[Any]] = {}
        self._step_optimizers: list[tuple[str, Optimizer]] = []
        self._epoch_optimizers: list[tuple[str, Optimizer]] = []
        self._every = 1

    # --- hooks ------------------------------------------------------------------------------------
    def on_train_start(self, trainer: TrainerProtocol) -> None:
        # An optimizer's rate changes when its schedulers step: per step if any of them does.
        intervals: dict[int, set[str]] = {}
        for _, sched in trainer.named_schedulers():
            intervals.setdefault(id(sched.optimizer), set()).add(trainer.scheduler_interval(sched))
        self._step_optimizers, self._epoch_optimizers = [], []
        for name, opt in trainer.named_optimizers():
            interval = self.logging_interval
            if interval is None:
                own = intervals.get(id(opt))
                interval = "step" if own is None or "step" in own else "epoch"
            (self._step_optimizers if interval == "step" else self._epoch_optimizers).append((name, opt))
        self._every = trainer.config.log_every_n_steps
        if self.log_momentum:
            missing = [
                n
                for n, o in trainer.named_optimizers()
                if any("momentum" not in g and "betas" not in g for g in o.param_groups)
            ]
            if missing:
                warn_user(
                    f"LearningRateMonitor(log_momentum=True): optimizers {missing} have no momentum; "
                    "their momentum is logged as 0.",
                    RuntimeWarning,
                )
        if self._step_optimizers and trainer.global_step == 0:
            self._log(trainer, self._step_optimizers)

    def on_train_epoch_start(self, trainer: TrainerProtocol) -> None:
        if self._epoch_optimizers:
            self._log(trainer, self._epoch_optimizers)

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Only at the end of a training step that is a logging step: by then the step's schedulers have
        # stepped, so the rates read are those of step `global_step`.
        if self._step_optimizers and trainer.loop.step_ended_every(self._every):
            self._log(trainer, self._step_optimizers)

    # --- reading and logging ----------------------------------------------------------------------
    def extract(self, optimizers: list[tuple[str, Optimizer]]) -> dict[str, Any]:
        """`{key: value}` of the current learning rates (and momentum / weight decay) of `optimizers`."""
        return self._extract(optimizers, None)

    def _extract(self, optimizers: list[tuple[str, Optimizer]], lr_keys: list[str] | None) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        for name, opt in optimizers:
            groups = opt.param_groups
            for i, group in enumerate(groups):
                key = f"lr-{name}"
                group_name = group.get("name")
                if len(groups) > 1:
                    key = f"{key}/{group_name if group_name else f'pg{i + 1}'}"
                elif group_name:
                    key = f"{key}/{group_name}"
                stats[key] = _snapshot(group["lr"])
                if lr_keys is not None:
                    lr_keys.append(key)
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                    stats[f"{key}-momentum"] = _snapshot(momentum)
                if self.log_weight_decay:
                    stats[f"{key}-weight_decay"] = _snapshot(group.get("weight_decay", 0.0))
        return stats

    def _log(self, trainer: TrainerProtocol, optimizers: list[tuple[str, Optimizer]]) -> None:
        lr_keys: list[str] = []
        stats = self._extract(optimizers, lr_keys)
        for key in lr_keys:
            self.lrs.setdefault(key, []).append(stats[key])
        trainer.log_metrics(stats, step=trainer.global_step)


def _snapshot(value: Any) -> Any:
    # A tensor learning rate is updated in place by its scheduler, and logged values are read back
    # lazily: copy it (no sync) so the value logged is the one of this step.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value

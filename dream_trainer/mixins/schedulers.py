"""SchedulerMixin: the learning rate over the run: LR schedulers and `lr_at_step`.

At setup (`_bind_schedulers`) the schedulers are split once by when they step: after each optimizer step
(held per optimizer, so a step looks up only its own), or at each epoch's end. `lr_at_step(step)`, when a
trainer overrides it, replaces them: a writer held among each optimizer's per-step schedulers sets every
param group's rate for the next step. A `ReduceLROnPlateau` scheduler monitors a metric that
`LoggingMixin` gives (`_latest_metrics`). The optimizer step that steps the per-step schedulers is
`OptimizerStepMixin`'s (`dream_trainer.mixins.optimizer_step`); the epoch's end steps the others.
`estimated_stepping_batches` is the run's length in training steps, what a per-step scheduler is sized by
(`transformers`' `num_training_steps`); the training epoch's length it reads is `SetupMixin`'s
(`_train_epoch_length`). See `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError
from dream_trainer.lightning.optimizer_forms import OptimizerForms
from dream_trainer.mixins.core import TrainerCore


class _LRAtStep:
    """Writes the trainer's `lr_at_step(step)` into every param group of its optimizers. Held among the
    per-step schedulers of each optimizer (`_schedulers_by_optimizer`), so it runs after every optimizer
    step, where it writes the next step's rate, and costs nothing to a trainer without `lr_at_step`."""

    def __init__(self, rate: Callable[[int], float | None], optimizers: tuple[Optimizer, ...], loop: Any) -> None:
        self._rate = rate
        self._optimizers = optimizers
        self._loop = loop

    def write(self, step: int) -> None:
        """Set every group's `"lr"` to `lr_at_step(step)` (left as it is when that returns None)."""
        lr = self._rate(step)
        if lr is None:
            return
        for opt in self._optimizers:
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # a tensor lr (capturable/fused): kept a tensor
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr

    def step(self) -> None:
        # After an optimizer step of training step `global_step` (not yet advanced): the next one's rate.
        self.write(self._loop.global_step + 1)


class SchedulerMixin(TrainerCore):
    """Steps the LR schedulers (per step or per epoch) and writes `lr_at_step`'s rates."""

    _optimizer_forms: OptimizerForms
    """Lightning's `configure_optimizers` return forms: a returned scheduler's interval and monitor are
    read here. Created and written by `OptimizationMixin`."""

    def _init_schedulers(self) -> None:
        self._step_schedulers: bool = self.config.scheduler_interval == "step"
        self._lr_writer: _LRAtStep | None = None  # set at setup (`_bind_schedulers`): the writer of `lr_at_step`

    def _bind_schedulers(self, optimizers: list[tuple[str, Optimizer]], schedulers: list[tuple[str, Any]]) -> None:
        """At setup, after the optimizers are bound (`optimizers`: by attribute name, in order)."""
        optimizer_list = tuple(o for _, o in optimizers)
        # Split once here by interval, so a step only looks up its optimizer's per-step schedulers.
        by_opt: dict[Optimizer, list[Any]] = {}
        per_epoch: list[Any] = []
        for _, sched in schedulers:
            if self.scheduler_interval(sched) == "step":
                by_opt.setdefault(sched.optimizer, []).append(sched)
            else:
                per_epoch.append(sched)
        self._lr_writer = None
        if type(self).lr_at_step is not SchedulerMixin.lr_at_step:
            self._lr_writer = _LRAtStep(self.lr_at_step, optimizer_list, self._loop)
            if schedulers:
                sched_name, sched = schedulers[0]
                opt_name = {o: n for n, o in optimizers}.get(sched.optimizer, "optimizer")
                raise MisconfigurationError(
                    f"{type(self).__name__}.lr_at_step and the scheduler self.{sched_name} both set the learning "
                    f"rate of self.{opt_name}: keep one (remove the scheduler, or "
                    "lr_at_step, which gives every step's rate itself)."
                )
            for opt in optimizer_list:  # it writes the next step's rate after every optimizer step
                by_opt.setdefault(opt, []).append(self._lr_writer)
        self._schedulers_by_optimizer: dict[Optimizer, tuple[Any, ...]] = {o: tuple(s) for o, s in by_opt.items()}
        self._scheduler_list: tuple[Any, ...] = tuple(per_epoch)  # those stepped at the end of each epoch
        self._step_schedulers = bool(by_opt)

    def scheduler_interval(self, scheduler: Any) -> str:
        """When `scheduler` steps: `"step"` (after each optimizer step) or `"epoch"` (at each epoch's end).
        Its `"interval"` when `configure_optimizers` returned it in a dict, else `config.scheduler_interval`."""
        options = self._optimizer_forms.scheduler_options.get(id(scheduler))
        return options[0] if options is not None else self.config.scheduler_interval

    @property
    def estimated_stepping_batches(self) -> int:
        """The training steps (accumulation windows) this run takes: how many times each optimizer steps, so
        the length a scheduler stepped after every optimizer step is sized by (`transformers`'
        `num_training_steps`, `OneCycleLR`'s `total_steps`). Lightning's name and meaning: read it in
        `configure_optimizers`, where the training loader is loaded for it if setup has not loaded it yet.

        With `max_steps` alone it is `max_steps`. With `n_epochs` it is `n_epochs * ceil(batches per epoch /
        gradient_accumulation_steps)` (an epoch's last window may be short), the batches being this
        process's share after `limit_train_batches`, and at most `max_steps`. It counts the whole run, not
        what is left of it, so a resumed run with the same settings sizes its scheduler as the first did.
        Computed from the config and the loader's length each time it is read (no batch is fetched). An
        estimate in the way Lightning's is: a run stopped early (`should_stop`, `on_train_batch_start`
        returning -1) takes fewer steps, and loaders of another length later
        (`reload_dataloaders_every_n_epochs`) do not resize a scheduler sized at setup.

        Raises:
            MisconfigurationError: with `n_epochs`, when read before `fit()` sets the trainer up, when the
                training loader has no length (an iterable dataset, a generator) and `max_steps` is None,
                or when there is no training loader.
        """
        cfg = self.config
        if cfg.n_epochs is None:  # the config holds max_steps then (neither: n_epochs = 1)
            assert cfg.max_steps is not None
            return cfg.max_steps
        per_epoch = self._train_epoch_length()
        if per_epoch is None:
            if cfg.max_steps is not None:
                return cfg.max_steps
            raise MisconfigurationError(
                f"{type(self).__name__}.estimated_stepping_batches: the training loader has no length (an "
                "iterable dataset or a generator), so the steps of an epoch are unknown: set config.max_steps, "
                "which then ends the run, or give the loader a __len__."
            )
        steps = cfg.n_epochs * math.ceil(per_epoch / cfg.gradient_accumulation_steps)
        return steps if cfg.max_steps is None else min(steps, cfg.max_steps)

    def _train_epoch_length(self) -> int | None:
        """Batches in one training epoch on this process after `limit_train_batches` (None: the loader has
        no length), loading the loaders first when setup has not yet (`configure_optimizers` reads
        `estimated_stepping_batches` before setup loads them).

        Implemented by `SetupMixin`, which owns the loaders and the setup phase.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no training loader to measure: SetupMixin implements "
            "_train_epoch_length(); compose SchedulerMixin into a trainer that has SetupMixin (DreamTrainer does)."
        )

    def lr_at_step(self, step: int) -> float | None:
        """Override to give the learning rate of training step `step` (0-based: `global_step` when the
        step starts), e.g. a warmup and cosine decay. The trainer writes it into `param_group["lr"]` of
        every param group of every optimizer before that step, as a plain loop sets
        `param_group["lr"] = lr` (bit for bit the same): at the start of `fit()`, then after each
        optimizer step for the next one. Return None to leave the rates as they are. It replaces an LR
        scheduler (a trainer with both is refused at setup). Not overridden: the trainer never calls it.
        """
        return None

    def _start_lr_at_step(self) -> None:
        """At the start of `fit()` (after a resume): the rate of the step about to run."""
        if self._lr_writer is not None:
            self._lr_writer.write(self._loop.global_step)

    @contextlib.contextmanager
    def _schedulers_held(self) -> Iterator[None]:
        """Per-step schedulers do not step inside the block (a tuning run sets the learning rate)."""
        step_schedulers, self._step_schedulers = self._step_schedulers, False
        try:
            yield
        finally:
            self._step_schedulers = step_schedulers

    def _latest_metrics(self) -> Mapping[str, float]:
        """The latest reduced metrics, which a `ReduceLROnPlateau` scheduler monitors.

        Implemented by `LoggingMixin` (its `callback_metrics`), the layer above this one.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no metrics to give ReduceLROnPlateau: LoggingMixin implements "
            "_latest_metrics(); compose SchedulerMixin into a trainer that has LoggingMixin (DreamTrainer does)."
        )

    def _step_scheduler(self, scheduler: Any) -> None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            options = self._optimizer_forms.scheduler_options.get(id(scheduler))
            monitor = options[1] if options is not None else self.config.scheduler_monitor
            metrics = self._latest_metrics()
            if monitor not in metrics:
                where = "config.scheduler_monitor" if options is None else "the monitor configure_optimizers returned"
                raise KeyError(
                    f"ReduceLROnPlateau needs {where}={monitor!r} in trainer.callback_metrics, "
                    f"which holds {sorted(metrics)}. Return or log that metric, or set scheduler_monitor."
                )
            scheduler.step(metrics[monitor])
        else:
            scheduler.step()

    def _step_epoch_schedulers(self) -> None:
        for sched in self._scheduler_list:  # only the per-epoch ones (see `_bind_schedulers`)
            self._step_scheduler(sched)

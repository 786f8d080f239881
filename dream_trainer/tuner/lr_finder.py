"""The learning-rate range test (Leslie Smith; Lightning's `Tuner.lr_find`).

The learning rate rises from `min_lr` to `max_lr` over `num_training` optimizer steps, exponentially
(evenly on a log scale) or linearly. Each step is the trainer's own training step; its loss (the mean
over the accumulation window) is smoothed with a bias-corrected moving average. The test stops early
when the smoothed loss exceeds `early_stop_threshold` times the best so far, or is not finite. The
suggestion is the learning rate where the smoothed loss falls fastest: the minimum of its gradient
(unit spacing: per step, that is per decade-fraction in exponential mode), the first 10 and last
point skipped, as Lightning does. The trainer is restored afterwards (see `tuning_session`).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.trainer import DreamTrainer
from dream_trainer.tuner.plot import plot_curve
from dream_trainer.tuner.session import cycle_batches, required_loss, tuning_session

MODES = ("exponential", "linear")
SMOOTHING = 0.98  # Lightning's beta: the moving average of the loss


@dataclass
class LRFinderResult:
    """What `lr_find` measured: one entry per optimizer step, in order.

    Attributes:
        lrs: the learning rate of each step.
        losses: the smoothed loss after each step (what is plotted and searched).
        raw_losses: the loss of each step as the training step returned it (window mean).
        mode: "exponential" or "linear".
        stopped_early: True when the loss diverged (or became NaN/inf) before `num_training` steps.
        suggested_index: the index of `suggestion()` with its defaults (None: too few points).
    """

    lrs: list[float]
    losses: list[float]
    raw_losses: list[float]
    mode: str
    stopped_early: bool
    suggested_index: int | None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate at the steepest descent of the smoothed loss, leaving out the first
        `skip_begin` and last `skip_end` points; None when fewer than two finite points remain."""
        index = suggest_index(self.losses, skip_begin, skip_end)
        return None if index is None else self.lrs[index]

    def plot(self, path: str | os.PathLike[str], size: tuple[int, int] = (640, 400)) -> Path:
        """Write the curve (smoothed loss against learning rate, the suggestion marked) as a PNG."""
        suggested = "" if self.suggested_index is None else f": suggested {self.lrs[self.suggested_index]:.3g}"
        return plot_curve(
            path,
            self.lrs,
            self.losses,
            log_x=self.mode == "exponential",
            mark=self.suggested_index,
            title=f"learning-rate range test{suggested}",
            x_label="learning rate",
            y_label="smoothed loss",
            size=size,
        )


def suggest_index(losses: list[float], skip_begin: int = 10, skip_end: int = 1) -> int | None:
    """Index (into `losses`) of the most negative gradient of `losses[skip_begin:len - skip_end]`,
    non-finite points left out; None when fewer than two remain."""
    if skip_begin < 0 or skip_end < 0:
        raise ValueError(f"skip_begin={skip_begin!r}, skip_end={skip_end!r}: expected integers >= 0")
    indices = [i for i in range(skip_begin, len(losses) - skip_end) if math.isfinite(losses[i])]
    if len(indices) < 2:
        return None
    gradient = torch.gradient(torch.tensor([losses[i] for i in indices], dtype=torch.float64))[0]
    return indices[int(torch.argmin(gradient))]


def lr_schedule(min_lr: float, max_lr: float, num_training: int, mode: str) -> list[float]:
    """The learning rate of each of the `num_training` steps: from `min_lr` to `max_lr` inclusive."""
    fractions = [i / (num_training - 1) for i in range(num_training)]
    if mode == "exponential":
        return [min_lr * (max_lr / min_lr) ** f for f in fractions]
    return [min_lr + f * (max_lr - min_lr) for f in fractions]


def lr_find(
    trainer: DreamTrainer,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    optimizer: Optimizer | str | None = None,
    plot_path: str | os.PathLike[str] | None = None,
) -> LRFinderResult:
    """Run the learning-rate range test on `trainer` and restore it afterwards.

    Args:
        trainer: the trainer (set up here if `fit()` has not run).
        min_lr, max_lr: the first and last learning rate.
        num_training: optimizer steps (accumulation windows) to run, at most.
        mode: "exponential" (even steps of log lr) or "linear".
        early_stop_threshold: stop once the smoothed loss exceeds this times the best one; None: never.
        optimizer: the optimizer whose learning rate is swept (every param group gets the same value):
            an optimizer or its attribute name; None: the trainer's only one.
        plot_path: also write the curve as a PNG there (rank zero).

    Returns:
        The `LRFinderResult`; `result.suggestion()` is the suggested learning rate.
    """
    _check_arguments(min_lr, max_lr, num_training, mode, early_stop_threshold)
    with tuning_session(trainer, "lr_find"):
        target = _pick_optimizer(trainer, optimizer)
        schedule = lr_schedule(min_lr, max_lr, num_training, mode)
        lrs: list[float] = []
        raw: list[float] = []
        smoothed: list[float] = []
        average, best = 0.0, math.inf
        stopped_early = False
        window: list[torch.Tensor] = []
        loop = trainer.loop
        for batch_idx, batch in cycle_batches(trainer):
            if loop.window_pos == 0:  # a new optimizer step: its learning rate
                lr = schedule[len(lrs)]
                for group in target.param_groups:
                    group["lr"] = lr
                lrs.append(lr)
            try:
                outputs = trainer.training_step(batch, batch_idx)
            except NonFiniteGradientError:  # non_finite_grads="raise"/"retry": the loss diverged
                window = [torch.tensor(math.nan)]
                loop.abandon_window()
            else:
                window.append(required_loss(outputs, "lr_find", trainer))
            if loop.window_pos:
                continue  # inside an accumulation window
            loss = torch.stack([w.float().cpu() for w in window]).mean()  # SYNC: once per step
            window = []
            if trainer.is_distributed:  # every rank sees the same curve and stops at the same step
                loss = trainer.all_reduce(loss.to(trainer.device), "mean").cpu()
            value = float(loss)
            raw.append(value)
            step = len(raw)
            average = SMOOTHING * average + (1 - SMOOTHING) * value
            smoothed.append(average / (1 - SMOOTHING**step))
            if not math.isfinite(smoothed[-1]):
                stopped_early = step < num_training
                break
            if early_stop_threshold is not None and step > 1 and smoothed[-1] > early_stop_threshold * best:
                stopped_early = step < num_training
                break
            best = min(best, smoothed[-1])
            if step >= num_training:
                break
    result = LRFinderResult(lrs[: len(raw)], smoothed, raw, mode, stopped_early, suggest_index(smoothed))
    if trainer.is_global_zero:
        suggested = "none (too few steps)" if result.suggested_index is None else f"{result.suggestion():.3g}"
        ending = "; stopped early: the loss diverged" if stopped_early else ""
        print(
            f"dream_trainer: lr_find ran {len(raw)} steps{ending}; suggested learning rate {suggested}", file=sys.stderr
        )
        if plot_path is not None:
            result.plot(plot_path)
    return result


def _check_arguments(
    min_lr: float, max_lr: float, num_training: int, mode: str, early_stop_threshold: float | None
) -> None:
    if not (isinstance(min_lr, (int, float)) and min_lr > 0):
        raise ValueError(f"lr_find(min_lr={min_lr!r}) is invalid: expected a positive number")
    if not (isinstance(max_lr, (int, float)) and max_lr > min_lr):
        raise ValueError(f"lr_find(max_lr={max_lr!r}) is invalid: expected a number above min_lr={min_lr!r}")
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 2:
        raise ValueError(f"lr_find(num_training={num_training!r}) is invalid: expected an integer >= 2")
    if mode not in MODES:
        raise ValueError(f"lr_find(mode={mode!r}) is invalid: valid choices are {', '.join(map(repr, MODES))}")
    if early_stop_threshold is not None and not (
        isinstance(early_stop_threshold, (int, float)) and early_stop_threshold > 1
    ):
        raise ValueError(
            f"lr_find(early_stop_threshold={early_stop_threshold!r}) is invalid: expected a number > 1 or None"
        )


def _pick_optimizer(trainer: DreamTrainer, optimizer: Optimizer | str | None) -> Optimizer:
    named = trainer.named_optimizers()
    names = ", ".join(n for n, _ in named)
    if isinstance(optimizer, Optimizer):
        if all(o is not optimizer for _, o in named):
            raise MisconfigurationError(f"lr_find(optimizer=...) is not one of the trainer's optimizers ({names})")
        return optimizer
    if isinstance(optimizer, str):
        for name, opt in named:
            if name == optimizer:
                return opt
        raise MisconfigurationError(f"lr_find(optimizer={optimizer!r}): the trainer has no such optimizer ({names})")
    if optimizer is not None:
        raise TypeError(f"lr_find(optimizer=...) takes an Optimizer, its attribute name or None; got {optimizer!r}")
    if len(named) != 1:
        raise MisconfigurationError(
            f"lr_find: {type(trainer).__name__} has {len(named)} optimizers ({names}): name the one to sweep, "
            f"lr_find(optimizer={named[0][0]!r})"
        )
    return named[0][1]

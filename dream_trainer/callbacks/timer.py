"""Timer: track training time and stop once a time budget is spent (Lightning's `Timer`)."""

from __future__ import annotations

import numbers
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_STAGES = ("train", "validate")


def _parse_duration(duration: str | timedelta | dict[str, float] | float | None) -> float | None:
    """`duration` in seconds (None stays None)."""
    if duration is None:
        return None
    seconds: float
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, dict):
        try:
            seconds = timedelta(**duration).total_seconds()
        except TypeError as exc:
            raise ConfigError(
                f"Timer(duration={duration!r}) is invalid: a dict takes timedelta's keys "
                "(days, hours, minutes, seconds, ...), e.g. {'hours': 1}"
            ) from exc
    elif isinstance(duration, str):
        parts = duration.strip().split(":")
        try:
            days, hours, minutes, secs = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(
                f"Timer(duration={duration!r}) is invalid: a string must be 'DD:HH:MM:SS', e.g. '00:12:00:00'"
            ) from None
        seconds = timedelta(days=days, hours=hours, minutes=minutes, seconds=secs).total_seconds()
    elif isinstance(duration, numbers.Real) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        raise ConfigError(
            f"Timer(duration={duration!r}) is invalid: expected a timedelta, a dict such as {{'hours': 1}}, "
            "a 'DD:HH:MM:SS' string, a number of seconds, or None"
        )
    if not seconds >= 0:
        raise ConfigError(f"Timer(duration={duration!r}) is invalid: the duration must not be negative")
    return seconds


class Timer(Callback):
    """Measure the time spent training, and stop training once it exceeds `duration`.

    Args:
        duration: the training time budget: a `timedelta`, a dict of `timedelta` keys
            (`{"hours": 1, "minutes": 30}`), a `"DD:HH:MM:SS"` string, a number of seconds, or None
            (only measure, never stop).
        interval: when to compare the elapsed time with `duration`: after every training step
            (`"step"`) or at the end of every epoch (`"epoch"`). One clock read per check.
        verbose: print a message when the time limit stops training.

    `time_elapsed("train")` counts from `on_train_start` to `on_train_end` (to `teardown` after a
    failure), plus the time of earlier runs when resumed from a checkpoint: the elapsed times are
    saved in checkpoints. `time_elapsed("validate")` is the duration of the latest validation run.
    `start_time(stage)` / `end_time(stage)` are `time.monotonic()` readings (None before / while
    running). A resumed run whose budget is already spent stops before its first step.
    """

    def __init__(
        self,
        duration: str | timedelta | dict[str, float] | float | None = None,
        interval: str = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in ("step", "epoch"):
            raise ConfigError(f"Timer(interval={interval!r}) is invalid: valid choices are 'step', 'epoch'")
        self._duration = _parse_duration(duration)
        self._interval = interval
        self._verbose = verbose
        self._start_time: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end_time: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0  # training time of earlier runs (from a checkpoint)
        self._check_steps = self._duration is not None and interval == "step"

    @property
    def duration(self) -> float | None:
        """The time budget in seconds (None: no limit)."""
        return self._duration

    # --- clock ------------------------------------------------------------------------------------
    def start_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when `stage` ("train" or "validate") last started, or None."""
        return self._start_time[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when `stage` last ended, or None (not started, or still running)."""
        return self._end_time[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in `stage`; for "train", including earlier runs restored from a checkpoint."""
        stage = _stage(stage)
        start, end = self._start_time[stage], self._end_time[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        if end is None:
            return time.monotonic() - start + offset
        return end - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of `duration` (negative once exceeded), or None without a duration."""
        if self._duration is None:
            return None
        return self._duration - self.time_elapsed(stage)

    # --- hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        # After a resume: a budget already spent stops the run before it trains at all.
        if self._duration is not None:
            self._check(trainer)

    def on_train_start(self, trainer: TrainerProtocol) -> None:
        self._start_time["train"] = time.monotonic()
        self._end_time["train"] = None

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        self._end_time["train"] = time.monotonic()

    def on_validation_start(self, trainer: TrainerProtocol) -> None:
        self._start_time["validate"] = time.monotonic()
        self._end_time["validate"] = None

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        self._end_time["validate"] = time.monotonic()

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._check_steps and trainer.loop.step_ended:  # once per training step
            self._check(trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        if self._duration is not None and self._interval == "epoch":
            self._check(trainer)

    def teardown(self, trainer: TrainerProtocol, stage: str) -> None:
        # After a failure on_train_end never ran: stop the clock so time_elapsed stays what it was.
        for s in _STAGES:
            if self._start_time[s] is not None and self._end_time[s] is None:
                self._end_time[s] = time.monotonic()

    def _check(self, trainer: TrainerProtocol) -> None:
        assert self._duration is not None
        should_stop = self.time_elapsed("train") >= self._duration
        if trainer.is_distributed:  # clocks differ between processes: rank zero decides for all
            should_stop = bool(trainer.broadcast(should_stop))
        if should_stop:
            trainer.should_stop = True
            if self._verbose and trainer.is_global_zero:
                elapsed = timedelta(seconds=int(self.time_elapsed("train")))
                print(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop.", flush=True)

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {s: self.time_elapsed(s) for s in _STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = float(state_dict.get("time_elapsed", {}).get("train", 0.0))


def _stage(stage: str) -> str:
    if stage not in _STAGES:
        raise ValueError(f"Timer stage {stage!r} is invalid: valid choices are 'train', 'validate'")
    return stage

"""Profiler: `torch.profiler` over a few training steps, traces viewable in TensorBoard."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class Profiler(Callback):
    """Profile training steps with `torch.profiler` and write traces for TensorBoard.

    The profiler starts with training and follows `torch.profiler.schedule(wait, warmup, active,
    repeat)` over training steps (accumulation windows): `wait` steps untouched, `warmup` steps traced
    and discarded, `active` steps recorded; `repeat` cycles (0: until training ends). At the end of each
    cycle a `<worker>.<timestamp>.pt.trace.json` file is written to `dirpath` (default
    `trainer.log_dir / "profiler"`); open it with `tensorboard --logdir <dirpath>` (the PyTorch profiler
    plugin) or `chrome://tracing` / Perfetto. CPU activity is always recorded, CUDA activity when the
    trainer runs on CUDA.

    Once the last cycle is written the profiler is stopped, so the rest of training runs without it.
    It is also stopped (and what it recorded written) when training ends early or fails.

    Args:
        wait, warmup, active, repeat: the schedule, in training steps.
        dirpath: where traces go (default `trainer.log_dir / "profiler"`).
        record_shapes: record operator input shapes.
        profile_memory: track tensor allocations and frees.
        with_stack: record Python source locations (bigger traces, more overhead).
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        dirpath: str | os.PathLike[str] | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        for name, value, low in (
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                what = "a positive integer" if low else "an integer >= 0"
                raise ConfigError(f"Profiler({name}={value!r}) is invalid: expected {what}")
        self.wait = wait
        self.warmup = warmup
        self.active = active
        self.repeat = repeat
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.profiler: profile | None = None
        self._steps = 0
        self._total_steps = (wait + warmup + active) * repeat  # 0: repeat until training ends
        self._resolved_dir: Path | None = None

    def resolved_dirpath(self, trainer: TrainerProtocol) -> Path:
        """The directory traces are written to."""
        return self.dirpath if self.dirpath is not None else trainer.log_dir / "profiler"

    @property
    def trace_dir(self) -> Path | None:
        """Where this run's traces went (None before training started)."""
        return self._resolved_dir

    def on_train_start(self, trainer: TrainerProtocol) -> None:
        self._stop()
        directory = self.resolved_dirpath(trainer)
        directory.mkdir(parents=True, exist_ok=True)
        self._resolved_dir = directory
        activities = [ProfilerActivity.CPU]
        if trainer.device.type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        worker = f"{socket.gethostname()}_{os.getpid()}"
        if trainer.world_size > 1:
            worker = f"rank{trainer.global_rank}_{worker}"
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat),
            on_trace_ready=tensorboard_trace_handler(str(directory), worker_name=worker),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._steps = 0
        self.profiler.start()

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        prof = self.profiler
        if prof is None or not trainer.loop.step_ended:  # only at the end of a training step
            return
        with warnings.catch_warnings():  # only while profiling: the profiler is stopped after its schedule
            # torch warns at each cycle end that key_averages() only sees the last cycle; traces are
            # written per cycle and this callback never calls key_averages().
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
            prof.step()
        self._steps += 1
        if self._total_steps and self._steps >= self._total_steps:
            self._stop()  # the schedule is done: no profiler overhead for the rest of training

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        self._stop()

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: TrainerProtocol, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        prof, self.profiler = self.profiler, None
        if prof is not None:
            prof.stop()

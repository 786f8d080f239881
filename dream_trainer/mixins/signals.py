"""SignalMixin: checkpoint-and-exit on SIGTERM/SIGINT (pre-emption, Ctrl-C).

The handler only records the signal; the loop acts on it at the next batch boundary (see
`dream_trainer.mixins.batch_end`; with several ranks: at the next logging point, where the ranks agree
so that all stop at the same step), so the checkpoint holds the state every checkpoint written between
two batches holds: the current batch finishes with its `on_train_batch_end` callbacks and the
validation its step is due for, the saves callbacks asked for there are written, then a checkpoint is
written synchronously (earlier background writes are waited for, nothing else), `last.ckpt` points to it,
and `fit()` raises `TrainingInterrupted`, a `SystemExit` with code 128 + signal number: hooks
(`on_exception`, `teardown`) run on the way out and an uncaught exit ends the process with that code.
Rank zero prints one line on stderr: what stopped, the checkpoint, and how to resume.

A second SIGINT while the first waits for the batch to end stops at once, without a checkpoint (the
run's earlier checkpoints stay; the line says so). Once the checkpoint is being written, further
signals only print that the save is under way: the save is never abandoned half-written, and the
run ends "interrupted" as the first signal asked.

This mixin detects the signal (handlers, the flag, the ranks' agreement); the reaction, a checkpoint
and the exit, is `CheckpointMixin._stop_on_signal`, the template declared here. So this module needs
no checkpoint code, and `TrainingInterrupted` can be imported from it (callbacks do) cheaply. See
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from dream_trainer.mixins.distributed import DistributedMixin

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(SystemExit):
    """Training stopped on a signal after saving `checkpoint_path`; `code` is 128 + signal number."""

    def __init__(self, signum: int, checkpoint_path: Path | None) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.checkpoint_path = checkpoint_path

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return f"training interrupted by {name}; checkpoint: {self.checkpoint_path} (exit code {self.code})"

    def summary(self, global_step: int) -> str:
        """The line printed when training stops on the signal: what stopped, where the checkpoint is,
        and the call (or CLI flag) that resumes."""
        name = signal.Signals(self.signum).name
        resume = 'resume with fit(ckpt_path="last") (CLI: --ckpt_path last)'
        if self.checkpoint_path is None:
            return (
                f"stopped by a second {name} at global step {global_step} before a checkpoint was written; "
                f"{resume} from the last checkpoint saved earlier"
            )
        return f"stopped by {name} at global step {global_step}; checkpoint {self.checkpoint_path}; {resume}"


class SignalMixin(DistributedMixin):
    """Installs the handlers for the duration of `fit()` (main thread only) and restores them after."""

    def _init_signals(self) -> None:
        self._signal_received: int | None = None
        self._stopping_on_signal: bool = False  # the checkpoint a signal asked for is being written
        self._told_to_wait: bool = False
        self._agree_on_signals: bool = False
        self._previous_handlers: dict[int, Any] = {}

    def _install_signal_handlers(self) -> None:
        self._signal_received = None
        self._stopping_on_signal = self._told_to_wait = False
        self._agree_on_signals = self.config.handle_signals and self.is_distributed
        if not self.config.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal_received is None:
            self._signal_received = signum  # acted on at the next batch boundary
            return
        if self._stopping_on_signal:  # the checkpoint is being written (or fit() is ending): let it finish
            if not self._told_to_wait:
                self._told_to_wait = True
                self._say(f"{signal.Signals(signum).name} again: still writing the checkpoint, then stopping")
            return
        if signum == signal.SIGINT:  # a second Ctrl-C before the batch ended: stop now, without a checkpoint
            self._stopping_on_signal = True
            stop = TrainingInterrupted(signum, None)
            self._say(stop.summary(self._loop.global_step))
            raise stop

    def _say(self, line: str) -> None:
        # From a signal handler: os.write, never print (the handler may run inside a print to stderr).
        if self.is_global_zero:
            os.write(2, f"dream_trainer: {line}\n".encode())

    def _check_signal(self) -> None:
        """At a batch boundary: stop if a signal arrived. With several ranks, all must stop at the
        same step, so they agree (one small all-reduce) at logging points only, never every step."""
        if not self._agree_on_signals:
            if self._signal_received is not None:
                self._stopping_on_signal = True
                self._stop_on_signal()
            return
        if not self._loop.is_logging_step:
            return
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self._signal_received or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # SYNC: every rank, every log_every_n_steps
        if flag.item():
            self._signal_received = int(flag.item())
            self._stopping_on_signal = True
            self._stop_on_signal()

    def _stop_on_signal(self) -> None:
        """Called at batch boundaries once a signal arrived: save, then leave `fit()` by raising
        `TrainingInterrupted`. Implemented by `CheckpointMixin`, the layer above this one."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot save on a signal: CheckpointMixin implements _stop_on_signal(); "
            "compose SignalMixin into a trainer that has CheckpointMixin (DreamTrainer does)."
        )

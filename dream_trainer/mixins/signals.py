"""SignalMixin: checkpoint-and-exit on SIGTERM/SIGINT (pre-emption, Ctrl-C).

The handler only records the signal; the loop acts on it at the next batch boundary (with several
ranks: at the next logging point, where the ranks agree so that all stop at the same step), so the
checkpoint holds a consistent state: the current batch finishes, a checkpoint is written
synchronously (earlier background writes are waited for, nothing else), `last.ckpt` points to it,
and `fit()` raises `TrainingInterrupted`, a `SystemExit` with code 128 + signal number: hooks
(`on_exception`, `teardown`) run on the way out and an uncaught exit ends the process with that code.
A second SIGINT while the first is pending interrupts at once (KeyboardInterrupt).

This mixin detects the signal (handlers, the flag, the ranks' agreement); the reaction, a checkpoint
and the exit, is `CheckpointMixin._stop_on_signal`, the template declared here. So this module needs
no checkpoint code, and `TrainingInterrupted` can be imported from it (callbacks do) cheaply. See
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

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


class SignalMixin(DistributedMixin):
    """Installs the handlers for the duration of `fit()` (main thread only) and restores them after."""

    def _init_signals(self) -> None:
        self._signal_received: int | None = None
        self._agree_on_signals: bool = False
        self._previous_handlers: dict[int, Any] = {}

    def _install_signal_handlers(self) -> None:
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
        if self._signal_received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self._signal_received = signum

    def _check_signal(self) -> None:
        """After a training step: stop if a signal arrived. With several ranks, all must stop at the
        same step, so they agree (one small all-reduce) at logging points only, never every step."""
        if not self._agree_on_signals:
            if self._signal_received is not None:
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
            self._stop_on_signal()

    def _stop_on_signal(self) -> None:
        """Called at batch boundaries once a signal arrived: save, then leave `fit()` by raising
        `TrainingInterrupted`. Implemented by `CheckpointMixin`, the layer above this one."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot save on a signal: CheckpointMixin implements _stop_on_signal(); "
            "compose SignalMixin into a trainer that has CheckpointMixin (DreamTrainer does)."
        )

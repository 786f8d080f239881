"""Exceptions raised by dream_trainer.

Every error says what to change: the setting or method, the value seen, and what is valid.
"""

from __future__ import annotations

import signal
from pathlib import Path


class DreamTrainerError(Exception):
    """Base class of every error dream_trainer raises on its own account."""


class ConfigError(DreamTrainerError, ValueError):
    """A `DreamTrainerConfig` field holds a value the trainer cannot run with."""


class MisconfigurationError(DreamTrainerError, RuntimeError):
    """The trainer subclass is missing something `fit()` needs (a method, an optimizer, ...)."""


class CallbackHookError(DreamTrainerError, AttributeError):
    """A callback defines a method that looks like a hook but is not one."""


class NonFiniteGradientError(DreamTrainerError, FloatingPointError):
    """Gradients were NaN or infinite and the policy says to stop (or retries ran out)."""


class CheckpointError(DreamTrainerError, RuntimeError):
    """A checkpoint could not be read, or does not fit this trainer."""


class LoggerWriteError(DreamTrainerError, OSError):
    """A logger could not write its file (disk full, permission denied, ...): an `OSError` with the
    original `errno`, whose message names the logger, the file and what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


# Not a DreamTrainerError: stopping on a signal is no error (a SystemExit with code 128 + the signal).
class TrainingInterrupted(SystemExit):
    """Training stopped on a signal after saving `checkpoint_path`; `code` is 128 + signal number.
    `requeue`: in a SLURM job stopped by `config.requeue_signal`, whether the job was requeued and the
    phrase that says so (or why it could not be)."""

    def __init__(self, signum: int, checkpoint_path: Path | None, requeue: tuple[bool, str] | None = None) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.checkpoint_path = checkpoint_path
        self.requeue = requeue

    @property
    def outcome(self) -> str:
        """The run's status in run.json: "requeued" when the SLURM job was requeued, else "interrupted"."""
        return "requeued" if self.requeue is not None and self.requeue[0] else "interrupted"

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
        if self.requeue is not None and self.requeue[0]:
            resume = self.requeue[1]
        elif self.requeue is not None:
            resume = f"{self.requeue[1]}; {resume}"
        return f"stopped by {name} at global step {global_step}; checkpoint {self.checkpoint_path}; {resume}"

"""Exceptions raised by dream_trainer.

Every error says what to change: the setting or method, the value seen, and what is valid.
"""

from __future__ import annotations


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

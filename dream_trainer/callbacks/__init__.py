"""Callbacks: the base class and the bus."""

from dream_trainer.callbacks.base import HOOKS, Callback
from dream_trainer.callbacks.bus import CallbackBus, CallbackList
from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint

__all__ = ["HOOKS", "Callback", "CallbackBus", "CallbackList", "ModelCheckpoint"]

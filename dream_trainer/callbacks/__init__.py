"""Callbacks: the base class and the bus."""

from dream_trainer.callbacks.base import HOOKS, Callback
from dream_trainer.callbacks.bus import CallbackBus, CallbackList

__all__ = ["HOOKS", "Callback", "CallbackBus", "CallbackList"]

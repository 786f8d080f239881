"""The mixins `DreamTrainer` is composed of, one concern each."""

from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.checkpoint import CheckpointMixin
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.mixins.hooks import HooksMixin
from dream_trainer.mixins.logging import LoggingMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.step import StepMixin

__all__ = [
    "AMPMixin",
    "CheckpointMixin",
    "DistributedMixin",
    "HooksMixin",
    "LoggingMixin",
    "OptimizationMixin",
    "SetupMixin",
    "StepMixin",
]

"""The mixins `DreamTrainer` is composed of, one concern each, layered on `TrainerCore`.

Each mixin inherits from the mixins it uses; `dream_trainer.mixins.core` describes the layers.
"""

from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.checkpoint import CheckpointMixin
from dream_trainer.mixins.core import TrainerCore
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.mixins.evaluation import EvaluationMixin
from dream_trainer.mixins.hooks import HooksMixin
from dream_trainer.mixins.logging import LoggingMixin
from dream_trainer.mixins.metrics import MetricsMixin
from dream_trainer.mixins.optimization import OptimizationMixin
from dream_trainer.mixins.setup import SetupMixin
from dream_trainer.mixins.state_format import StateFormatMixin
from dream_trainer.mixins.step import StepMixin

__all__ = [
    "AMPMixin",
    "CheckpointMixin",
    "DistributedMixin",
    "EvaluationMixin",
    "HooksMixin",
    "LoggingMixin",
    "MetricsMixin",
    "OptimizationMixin",
    "SetupMixin",
    "StateFormatMixin",
    "StepMixin",
    "TrainerCore",
]

"""Callbacks: the base class, the bus, and the built-in callbacks (one file each)."""

from dream_trainer.callbacks.base import HOOKS, Callback
from dream_trainer.callbacks.bus import CallbackBus, CallbackList
from dream_trainer.callbacks.device_stats import DeviceStatsMonitor
from dream_trainer.callbacks.early_stopping import EarlyStopping
from dream_trainer.callbacks.ema import EMA
from dream_trainer.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from dream_trainer.callbacks.garbage_collection import GarbageCollection
from dream_trainer.callbacks.grad_norm import GradientNormMonitor
from dream_trainer.callbacks.lambda_callback import LambdaCallback
from dream_trainer.callbacks.lr_monitor import LearningRateMonitor
from dream_trainer.callbacks.model_checkpoint import ModelCheckpoint
from dream_trainer.callbacks.model_summary import ModelSummary
from dream_trainer.callbacks.prediction_writer import BasePredictionWriter, PredictionWriter
from dream_trainer.callbacks.profiler import Profiler
from dream_trainer.callbacks.progress_base import ProgressBarBase
from dream_trainer.callbacks.rich_progress import RichProgressBar
from dream_trainer.callbacks.swa import StochasticWeightAveraging
from dream_trainer.callbacks.text_progress import TextProgress
from dream_trainer.callbacks.throughput import ThroughputMonitor
from dream_trainer.callbacks.timer import Timer
from dream_trainer.callbacks.weight_averaging import WeightAveraging

__all__ = [
    "HOOKS",
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "Callback",
    "CallbackBus",
    "CallbackList",
    "DeviceStatsMonitor",
    "EMA",
    "EarlyStopping",
    "GarbageCollection",
    "GradientNormMonitor",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "PredictionWriter",
    "Profiler",
    "ProgressBarBase",
    "RichProgressBar",
    "StochasticWeightAveraging",
    "TextProgress",
    "ThroughputMonitor",
    "Timer",
    "WeightAveraging",
]

BUILTINS: tuple[str, ...] = tuple(
    n
    for n in __all__
    if n
    not in {
        "HOOKS",
        "BaseFinetuning",
        "BasePredictionWriter",
        "Callback",
        "CallbackBus",
        "CallbackList",
        "ProgressBarBase",
        "WeightAveraging",
    }
)
"""The built-in callbacks, every public name but the framework's own pieces: what
`dream_trainer.registry.CALLBACKS` names (a config's `"type"`). A callback exported here is registered."""

"""`Tuner(trainer)`: Lightning's spelling of the learning-rate and batch-size finders, which are
`dream_trainer.tuner.lr_find` and `dream_trainer.tuner.scale_batch_size`. Exported as
`dream_trainer.tuner.Tuner` (Lightning's own is `lightning.pytorch.tuner.tuning.Tuner`, hence the name).

It lives here, above the trainer, because it imports the trainer and the finders; the `lightning`
package sits below the trainer and imports neither."""

from __future__ import annotations

import os

from torch.optim import Optimizer

from dream_trainer.trainer import DreamTrainer
from dream_trainer.tuner.batch_size_finder import scale_batch_size
from dream_trainer.tuner.lr_finder import LRFinderResult, lr_find


class Tuner:
    """Tuning tools bound to one trainer: `Tuner(trainer).lr_find()`, `Tuner(trainer).scale_batch_size()`.

    Both run training steps through the trainer's own step and restore the trainer afterwards (weights,
    optimizer state, RNG, counters); nothing is logged or checkpointed. Call them before `fit()`.
    """

    def __init__(self, trainer: DreamTrainer) -> None:
        if not isinstance(trainer, DreamTrainer):
            raise TypeError(f"Tuner(trainer) needs a DreamTrainer; got {type(trainer).__name__}")
        self.trainer = trainer

    def lr_find(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        optimizer: Optimizer | str | None = None,
        plot_path: str | os.PathLike[str] | None = None,
    ) -> LRFinderResult:
        """The learning-rate range test; see `dream_trainer.tuner.lr_find`."""
        return lr_find(
            self.trainer,
            min_lr=min_lr,
            max_lr=max_lr,
            num_training=num_training,
            mode=mode,
            early_stop_threshold=early_stop_threshold,
            optimizer=optimizer,
            plot_path=plot_path,
        )

    def scale_batch_size(
        self,
        mode: str = "power",
        init_val: int = 2,
        max_trials: int = 25,
        steps_per_trial: int = 3,
        batch_arg_name: str = "batch_size",
    ) -> int:
        """The largest batch size that fits, set on the trainer and returned; see
        `dream_trainer.tuner.scale_batch_size`."""
        return scale_batch_size(
            self.trainer,
            mode=mode,
            init_val=init_val,
            max_trials=max_trials,
            steps_per_trial=steps_per_trial,
            batch_arg_name=batch_arg_name,
        )

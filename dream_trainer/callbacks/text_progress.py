"""TextProgress: plain progress lines for logs and pipes, where a redrawn bar would be noise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dream_trainer.callbacks.progress_base import ProgressBarBase, format_duration, format_metrics

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class TextProgress(ProgressBarBase):
    """Prints one line every `every_seconds` of training (and one per validation), e.g.

    `epoch 2/10 | 120/400 | 35.2 it/s | eta 0:08 (run 1:40) | loss 0.4123  accuracy 0.91`
    """

    def __init__(self, every_seconds: float = 10.0) -> None:
        super().__init__(refresh_seconds=every_seconds)

    def line(self, trainer: TrainerProtocol) -> str:
        """The progress line for the current state."""
        n_epochs = trainer.config.n_epochs
        epoch = f"epoch {trainer.current_epoch + 1}" + (f"/{n_epochs}" if n_epochs else "")
        total = f"/{self.epoch_total}" if self.epoch_total is not None else ""
        parts = [
            epoch,
            f"{self.batch}{total}",
            f"{self.rate():.1f} it/s",
            f"eta {format_duration(self.epoch_eta())} (run {format_duration(self.run_eta(trainer))})",
        ]
        metrics = format_metrics(trainer.callback_metrics)
        if metrics:
            parts.append(metrics)
        return " | ".join(parts)

    def render(self, trainer: TrainerProtocol, force: bool = False) -> None:
        if not force and self.batch:  # the epoch's first and last lines come from the summary
            print(self.line(trainer), flush=True)

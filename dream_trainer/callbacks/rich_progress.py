"""RichProgressBar: a live terminal bar with epoch, step/total, it/s, ETA, metrics and a validation bar.

Also `default_progress_bar()`, the trainer's choice when none is attached: this bar on a terminal,
`TextProgress` otherwise. It lives here, above both bars, so that `progress_base` imports neither.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.progress_base import ProgressBarBase, format_duration, format_metrics
from dream_trainer.callbacks.text_progress import TextProgress

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class RichProgressBar(ProgressBarBase):
    """Draws with `rich.progress` (manual refresh, at most `1/refresh_seconds` times a second, so
    the bar costs nothing measurable per step). `print()` output appears above the bar."""

    def __init__(self, refresh_seconds: float = 0.25, console: Any = None) -> None:
        super().__init__(refresh_seconds=refresh_seconds)
        self.console = console
        self._progress: Any = None
        self._train_task: Any = None
        self._val_task: Any = None
        self._val_batches = 0

    def start(self, trainer: TrainerProtocol) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TextColumn("{task.fields[metrics]}"),
            console=self.console or Console(),
            auto_refresh=False,
            transient=False,
        )
        self._progress.start()
        self._train_task = self._progress.add_task("train", total=None, stats="", metrics="")

    def render(self, trainer: TrainerProtocol, force: bool = False) -> None:
        if self._progress is None:
            return
        n_epochs = trainer.config.n_epochs
        desc = f"epoch {trainer.current_epoch + 1}" + (f"/{n_epochs}" if n_epochs else "")
        stats = (
            f"{self.rate():.1f} it/s  eta {format_duration(self.epoch_eta())}"
            f" (run {format_duration(self.run_eta(trainer))})"
        )
        self._progress.update(
            self._train_task,
            description=desc,
            completed=self.batch,
            total=self.epoch_total,
            stats=stats,
            metrics=format_metrics(trainer.callback_metrics),
        )
        self._progress.refresh()

    # --- validation bar ---------------------------------------------------------------------------
    def on_validation_start(self, trainer: TrainerProtocol) -> None:
        if self._progress is None or not self._enabled:
            return
        self._val_batches = 0
        label = "sanity check" if trainer.sanity_checking else "validate"
        self._val_task = self._progress.add_task(label, total=None, stats="", metrics="")

    def on_validation_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._val_task is not None:
            self._val_batches += 1
            self._progress.update(self._val_task, completed=self._val_batches)

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        if self._val_task is not None:
            self._progress.remove_task(self._val_task)
            self._val_task = None
            self._progress.refresh()

    def stop(self, trainer: TrainerProtocol) -> None:
        if self._progress is not None:  # the last epoch's final state was drawn at its end
            self._progress.stop()
            self._progress = None


def default_progress_bar() -> ProgressBarBase:
    """A rich bar when stdout is a terminal, plain periodic lines otherwise (CI logs, files)."""
    if sys.stdout.isatty():
        return RichProgressBar()
    return TextProgress()

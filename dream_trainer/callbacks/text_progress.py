"""TextProgress: plain progress lines for logs and pipes, where a redrawn bar would be noise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dream_trainer.callbacks.progress_base import ProgressBarBase
from dream_trainer.callbacks.progress_layout import format_duration, format_rate, metric_items

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

FIRST_LINE_SECONDS = 1.0  # the default cadence: the first line after a second, then twice the gap each time


class TextProgress(ProgressBarBase):
    """Prints a progress line when `every_n_batches` training batches or the clock's interval have passed
    since the last one, whichever comes first; the trainer's epoch summary is the epoch's line.

        epoch 2/10 | 120/400 | 0:03<0:08 | 35.2 it/s | run eta 1:40 | loss 0.4123 | accuracy 0.91

    Args:
        every_n_batches: training batches between lines; None (the default): on the clock only.
        every_n_seconds: the longest time between lines (default 30). The first line comes after a
            second, and each gap is twice the one before, up to this: a run of a few seconds prints a
            handful of lines, a long one a line every `every_n_seconds` (with `every_n_batches` set, every
            gap is `every_n_seconds`: a keep-alive for slow batches). None: on the batch count only.
            A validation that runs longer than the gap prints lines too
            (`epoch 2/10 | validation 12/40 | 0:04<0:09 | 3.00 it/s`).

    No line is printed for an epoch's last batch, since the summary follows it; when
    `config.print_epoch_summary` is False that line is printed instead, so every epoch still ends with
    one line. Values are `trainer.progress_bar_metrics`, the numbers the loggers get, formatted as in the
    summary, once the epoch has had a logging step (before that, no numbers rather than the previous
    epoch's). A run that `max_steps` limits adds `step 520/1000` where the batch count is not the step
    count; a validation every `val_every_n_steps` prints its results when it ends:

        validation | step 120 | val_loss 1.2345 | val_accuracy 0.61 | 0:02
    """

    def __init__(self, every_n_batches: int | None = None, every_n_seconds: float | None = 30.0) -> None:
        if every_n_batches is not None and every_n_batches < 1:
            raise ValueError(f"every_n_batches must be a positive number of batches or None, not {every_n_batches}")
        if every_n_seconds is not None and every_n_seconds < 0:
            raise ValueError(f"every_n_seconds must be >= 0 or None, not {every_n_seconds}")
        first = float("inf") if every_n_seconds is None else every_n_seconds
        if every_n_batches is None:  # on the clock alone: soon at first, then less and less often
            first = min(FIRST_LINE_SECONDS, first)
        super().__init__(refresh_seconds=first)
        self.every_n_batches = every_n_batches
        self.every_n_seconds = every_n_seconds

    def batch_cadence(self) -> int | None:
        return self.every_n_batches

    def next_gap(self, gap: float) -> float:
        """Twice the last gap, at most `every_n_seconds`."""
        if self.every_n_seconds is None:
            return float("inf")
        return min(2 * gap, self.every_n_seconds)

    def line(self, trainer: TrainerProtocol) -> str:
        """The training progress line for the current state."""
        total = f"/{self.epoch_total}" if self.epoch_total is not None else ""
        parts = [_epoch_label(trainer), f"{self.batch}{total}", self._times(self.epoch_elapsed(), self.epoch_eta())]
        parts.append(format_rate(self.rate()))
        step = self.step_item(trainer)
        if step is not None:
            parts.append(step)
        run_eta = self.run_eta(trainer)
        if run_eta != float("inf"):
            parts.append(f"run eta {format_duration(run_eta)}")
        parts += metric_items(self.shown_metrics(trainer))
        return " | ".join(parts)

    def validation_line(self, trainer: TrainerProtocol) -> str:
        """The line for the running validation (or sanity check)."""
        total = f"/{self.val_total}" if self.val_total is not None else ""
        return " | ".join(
            [
                _epoch_label(trainer),
                f"{self.val_label} {self.val_batch}{total}",
                self._times(self.val_elapsed(), self.val_eta()),
                format_rate(self.val_rate()),
            ]
        )

    def render(self, trainer: TrainerProtocol, force: bool = False) -> None:
        if force:  # an epoch or validation starting has nothing to report yet
            return
        if self.val_label is not None:
            print(self.validation_line(trainer), flush=True)
        elif self.batch != self.epoch_total:  # the epoch's last line is its summary
            print(self.line(trainer), flush=True)

    def end_validation(self, trainer: TrainerProtocol) -> None:
        """A step-cadence validation's results (`validation_result`); an epoch's appear in its summary."""
        parts = self.validation_result(trainer)
        if parts is not None:
            print(" | ".join(parts), flush=True)

    def end_epoch(self, trainer: TrainerProtocol) -> None:
        """The epoch's line: the trainer's summary, or this bar's last line when the summary is off."""
        if not trainer.config.print_epoch_summary:
            print(self.line(trainer), flush=True)

    @staticmethod
    def _times(elapsed: float, remaining: float) -> str:
        return f"{format_duration(elapsed)}<{format_duration(remaining)}"


def _epoch_label(trainer: TrainerProtocol) -> str:
    n_epochs = trainer.config.n_epochs
    return f"epoch {trainer.current_epoch + 1}" + (f"/{n_epochs}" if n_epochs else "")

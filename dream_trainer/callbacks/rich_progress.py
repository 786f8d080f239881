"""RichProgressBar: a live terminal display, one line for training and one for a running validation,
each fitted to the terminal's width; cleared at the end of every epoch, where the summary takes its place.

Also `default_progress_bar()`, the trainer's choice when none is attached: this bar on a terminal,
`TextProgress` otherwise. It lives here, above both bars, so that `progress_base` imports neither.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.progress_base import ProgressBarBase
from dream_trainer.callbacks.progress_layout import (
    LineState,
    Segment,
    format_duration,
    format_rate,
    layout_lines,
    metric_items,
)
from dream_trainer.callbacks.text_progress import TextProgress
from dream_trainer.utils.numbers import join_to_width

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions

    from dream_trainer.protocol import TrainerProtocol

STYLES = {
    "label": "bold",
    "count": "",
    "bar_done": "magenta",
    "bar_todo": "bright_black",
    "time": "cyan",
    "extra": "",
    "space": "",
}


class ProgressView:
    """A snapshot of what to show, laid out when rich draws it, at the console's width then."""

    def __init__(self, lines: list[LineState]) -> None:
        self.lines = lines

    def segments(self, width: int) -> list[list[Segment]]:
        """The lines' segments at `width` columns."""
        return layout_lines(self.lines, width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        from rich.text import Text

        for segments in self.segments(options.max_width):
            text = Text(no_wrap=True, overflow="crop")
            for part, role in segments:
                text.append(part, STYLES[role])
            yield text


class RichProgressBar(ProgressBarBase):
    """The terminal display: a training line and, while validation or the sanity check runs, a line for
    it below, redrawn at most every `refresh_seconds`:

        epoch 2/5  100/100 ━━━━━━━━━━━━━━━━ 0:04<0:00  loss 0.1779  accuracy 0.9312
        validation     3/8 ━━━━━━────────── 0:01<0:01  3.00 it/s

    Each line keeps its label, count, bar and elapsed<remaining time; after them come the metrics
    (`trainer.progress_bar_metrics`: what the loggers get, in the epoch summary's number format), then the
    rate and the run's ETA, as many whole items as the width allows. A wider terminal gets a wider bar
    (a fifth of the width) and more items. The display is cleared when an epoch ends, so the epoch's
    summary line replaces it; with `config.print_epoch_summary=False` the last training line is left
    instead. `print()` output during an epoch appears above the display, and so does one line per
    validation run every `val_every_n_steps` (`validation | step 120 | val_loss 1.2345 | 0:02`), which
    stays. A run that `max_steps` limits counts to where it will stop, and adds `step 520/1000` where the
    batch count is not the step count.

    Args:
        refresh_seconds: the least time between redraws (the display costs nothing measurable per step).
        console: a `rich.console.Console` to draw on (default: a new one on stdout).
    """

    def __init__(self, refresh_seconds: float = 0.25, console: Any = None) -> None:
        super().__init__(refresh_seconds=refresh_seconds)
        self.console = console
        self._console: Any = None
        self._live: Any = None

    def start(self, trainer: TrainerProtocol) -> None:
        from rich.console import Console

        self._console = self.console or Console()

    def view(self, trainer: TrainerProtocol) -> ProgressView:
        """What the display shows now: the epoch's line while an epoch runs, and the validation's."""
        lines: list[LineState] = []
        if trainer.loop.epoch_in_progress:
            step = self.step_item(trainer)
            extras = [step] if step is not None else []
            extras += metric_items(self.shown_metrics(trainer))
            extras.append(format_rate(self.rate()))
            run_eta = self.run_eta(trainer)
            if run_eta != float("inf"):
                extras.append(f"run {format_duration(run_eta)}")
            n_epochs = trainer.config.n_epochs
            label = f"epoch {trainer.current_epoch + 1}" + (f"/{n_epochs}" if n_epochs else "")
            label = label.ljust(len("validation"))  # the bar stays put when a validation line joins it
            lines.append(
                LineState(label, self.batch, self.epoch_total, self.epoch_elapsed(), self.epoch_eta(), tuple(extras))
            )
        if self.val_label is not None:
            lines.append(
                LineState(
                    self.val_label,
                    self.val_batch,
                    self.val_total,
                    self.val_elapsed(),
                    self.val_eta(),
                    (format_rate(self.val_rate()),) if self.val_batch else (),
                )
            )
        return ProgressView(lines)

    def render(self, trainer: TrainerProtocol, force: bool = False) -> None:
        if self._console is None:
            return
        view = self.view(trainer)
        if self._live is None:
            from rich.live import Live

            # transient: stopping the display erases it, so the summary printed next is not doubled
            self._live = Live(view, console=self._console, auto_refresh=False, transient=True)
            self._live.start()
        self._live.update(view, refresh=True)

    def end_validation(self, trainer: TrainerProtocol) -> None:
        parts = self.validation_result(trainer)
        if parts is not None and self._console is not None:
            # Printed above the live display, where it stays: the results of a step-cadence validation.
            from rich.text import Text

            line = join_to_width(parts, self._console.width)
            self._console.print(Text(line, no_wrap=True, overflow="crop"))
        if trainer.loop.epoch_in_progress:
            self.render(trainer, force=True)  # back to the training line alone
        else:
            self._close(keep=False)  # the sanity check, or a validation after the last epoch

    def end_epoch(self, trainer: TrainerProtocol) -> None:
        if trainer.config.print_epoch_summary:
            self._close(keep=False)  # the summary the trainer prints next takes the display's place
        else:
            self.render(trainer, force=True)  # the epoch's final state stays as its line
            self._close(keep=True)

    def stop(self, trainer: TrainerProtocol) -> None:
        # After a failure the last state stays on screen: it says where the run stopped.
        self._close(keep=True)
        self._console = None

    def _close(self, keep: bool) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.transient = not keep
            live.stop()


def default_progress_bar() -> ProgressBarBase:
    """A rich bar when stdout is a terminal, plain periodic lines otherwise (CI logs, files)."""
    if sys.stdout.isatty():
        return RichProgressBar()
    return TextProgress()

"""ProgressBarBase: what every progress display counts and estimates; drawing is left to subclasses.

It reads only the trainer's public API (`num_training_batches`, `loop.epoch_length`, `global_step`,
`val_loader`, `config`, ...). It does not depend on the concrete displays: `RichProgressBar` and
`TextProgress` import it, and the factory choosing between them, `default_progress_bar`, lives in
`rich_progress`. How lines are written (durations, rates, widths) is `progress_layout`'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback
from dream_trainer.callbacks.progress_layout import format_duration, metric_items
from dream_trainer.utils.data import as_loader_list, limited_length

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class ProgressBarBase(Callback):
    """Counts batches and time on the hot path (an increment, a comparison and a clock read per batch)
    and calls `render()` at most every `refresh_seconds` (or every `batch_cadence()` batches, for a
    subclass that sets one); subclasses draw. Only global rank zero displays, and only during `fit()`.

    Training state: `batch` of `epoch_total` in the current epoch: the true position, also after a
    mid-epoch resume, and `epoch_total` is what the epoch will run (fewer batches when `max_steps` ends the
    run inside it). Rates and ETAs leave out the time validation takes, so they hold still while it runs.
    Validation state (also the sanity check): `val_label` ("validation" or "sanity check", None when none
    runs), `val_batch` of `val_total`.
    """

    def __init__(self, refresh_seconds: float = 0.25) -> None:
        self.refresh_seconds = refresh_seconds
        self._gap = refresh_seconds  # the time until the next render (`next_gap` may grow it)
        self.batch = 0  # batches done in this epoch
        self.epoch_total: int | None = None
        self.run_total: float = float("inf")  # training steps the run will take
        self.val_label: str | None = None
        self.val_batch = 0
        self.val_total: int | None = None
        self._next_render = 0.0
        self._next_render_batch: float = float("inf")  # the batch cadence's next line (inf: time only)
        self._cadence: int | None = None
        self._epoch_start = 0.0
        self._val_start = 0.0
        self._batch0 = 0  # the epoch's first batch (after a mid-epoch resume, where it resumed)
        self._first_batch = True  # the next batch end is the epoch's first
        self._paused = 0.0  # seconds of this epoch spent validating
        self._epoch_step0 = 0  # global_step when the epoch started (or resumed)
        self._enabled = False  # set at fit start: global rank zero displays

    # --- estimates --------------------------------------------------------------------------------
    def rate(self) -> float:
        """Training batches per second in this epoch so far (validation time left out)."""
        elapsed = self.epoch_elapsed() - self._paused - (self.val_elapsed() if self.val_label is not None else 0.0)
        return (self.batch - self._batch0) / elapsed if elapsed > 0 else 0.0

    def epoch_elapsed(self) -> float:
        """Seconds since this epoch started."""
        return time.perf_counter() - self._epoch_start

    def epoch_eta(self) -> float:
        """Seconds until this epoch's batches are done (inf when its length is unknown)."""
        return _eta(self.batch, self.epoch_total, self.rate())

    def run_eta(self, trainer: TrainerProtocol) -> float:
        """Seconds until training ends, from this epoch's pace (steps, accumulation included)."""
        rate = self.rate() / trainer.config.gradient_accumulation_steps
        if rate <= 0 or self.run_total == float("inf"):
            return float("inf")
        return max(0.0, self.run_total - trainer.global_step) / rate

    def val_elapsed(self) -> float:
        """Seconds since the running validation started."""
        return time.perf_counter() - self._val_start

    def val_rate(self) -> float:
        """Validation batches per second in the running validation."""
        elapsed = self.val_elapsed()
        return self.val_batch / elapsed if elapsed > 0 else 0.0

    def val_eta(self) -> float:
        """Seconds until the running validation ends (inf when its length is unknown)."""
        return _eta(self.val_batch, self.val_total, self.val_rate())

    # --- hooks ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        # Before the sanity check, so that it shows too.
        self._enabled = trainer.is_global_zero
        if self._enabled:
            self.start(trainer)

    def on_train_start(self, trainer: TrainerProtocol) -> None:
        cfg = trainer.config
        per_epoch = trainer.num_training_batches
        total = float("inf")
        if per_epoch is not None and cfg.n_epochs is not None:
            windows = -(-per_epoch // cfg.gradient_accumulation_steps)
            total = float(windows * cfg.n_epochs)
        if cfg.max_steps is not None:
            total = min(total, float(cfg.max_steps))
        self.run_total = total

    def on_train_epoch_start(self, trainer: TrainerProtocol) -> None:
        self.batch = self._batch0 = trainer.loop.resume_batch  # where a mid-epoch resume continues
        self._first_batch = True
        self._paused = 0.0
        self._epoch_step0 = trainer.global_step
        self.epoch_total = self._epoch_batches(trainer, self._batch0)
        self._epoch_start = time.perf_counter()
        self._next_render = self._epoch_start + self._gap
        self._cadence = self.batch_cadence()
        self._next_render_batch = self._cadence if self._cadence else float("inf")
        if self._enabled:
            self.render(trainer, force=True)

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._first_batch:
            self._first_batch = False
            if batch_idx != self._batch0:  # the epoch did not continue where the resume expected
                self._batch0 = batch_idx
                self.epoch_total = self._epoch_batches(trainer, batch_idx)
        self.batch = batch_idx + 1
        now = time.perf_counter()
        if (now >= self._next_render or self.batch >= self._next_render_batch) and self._enabled:
            # "N batches or S seconds since the last render, whichever comes first"
            self._gap = self.next_gap(self._gap)
            self._next_render = now + self._gap
            if self._cadence:
                self._next_render_batch = self.batch + self._cadence
            self.render(trainer)

    def on_validation_start(self, trainer: TrainerProtocol) -> None:
        if not self._enabled:
            return
        self.val_label = "sanity check" if trainer.sanity_checking else "validation"
        self.val_batch = 0
        self.val_total = _validation_length(trainer)
        self._val_start = time.perf_counter()
        self._next_render = self._val_start + self._gap
        self.render(trainer, force=True)

    def on_validation_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.val_batch += 1
        now = time.perf_counter()
        if now >= self._next_render and self._enabled:
            self._gap = self.next_gap(self._gap)
            self._next_render = now + self._gap
            self.render(trainer)

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        if self._enabled and self.val_label is not None:
            self._paused += self.val_elapsed()
            self.val_label = None
            self.end_validation(trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        # The trainer prints the epoch summary right after this hook (see `end_epoch`).
        if self._enabled:
            self.end_epoch(trainer)

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        if self._enabled:
            if trainer.loop.epoch_in_progress:  # max_steps or should_stop stopped training inside the epoch
                self.end_epoch(trainer)  # its line ends as at an epoch end (the trainer prints its summary next)
            self.stop(trainer)

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        if self._enabled:
            self.stop(trainer)

    # --- what to show ---------------------------------------------------------------------------------
    def shown_metrics(self, trainer: TrainerProtocol) -> dict[str, float]:
        """`trainer.progress_bar_metrics` once this epoch has had a logging step or has ended (its means
        are in); before that (an epoch shorter than `log_every_n_steps`) nothing, rather than the
        previous epoch's numbers again."""
        loop = trainer.loop
        step, every = trainer.global_step, loop.log_every_n_steps
        if self._epoch_step0 and not loop.epoch_exhausted and step - step % every <= self._epoch_step0:
            return {}
        return trainer.progress_bar_metrics

    def step_item(self, trainer: TrainerProtocol) -> str | None:
        """`step 520/1000` for a run that `max_steps` limits, where the batch count is not the step count
        (a later epoch, or accumulation); None otherwise."""
        max_steps = trainer.config.max_steps
        if max_steps is None or (trainer.current_epoch == 0 and trainer.config.gradient_accumulation_steps == 1):
            return None
        return f"step {trainer.global_step}/{max_steps}"

    def validation_result(self, trainer: TrainerProtocol) -> list[str] | None:
        """The parts of the line a step-cadence validation leaves on screen (`validation`, `step 120`,
        each metric, its duration), or None: the sanity check, and validations at epoch ends, whose
        results the epoch summary prints."""
        if trainer.sanity_checking or not trainer.loop.epoch_in_progress or trainer.config.val_every_n_steps is None:
            return None
        results = trainer.validation_metrics
        if not results:
            return None
        parts = ["validation", f"step {trainer.global_step}"]
        parts += metric_items(results)
        parts.append(format_duration(self.val_elapsed()))
        return parts

    def _epoch_batches(self, trainer: TrainerProtocol, start: int) -> int | None:
        """Batches this epoch runs: its length, or fewer when `max_steps` ends the run inside it."""
        length = trainer.loop.epoch_length
        max_steps = trainer.config.max_steps
        if length is None or max_steps is None:
            return length
        left = max(0, max_steps - self._epoch_step0) * trainer.config.gradient_accumulation_steps
        return min(length, start + left)

    # --- drawing (subclasses) ---------------------------------------------------------------------
    def batch_cadence(self) -> int | None:
        """Render every this many training batches as well as every `refresh_seconds` (None: time
        only). Asked at every epoch start, when `epoch_total` is known."""
        return None

    def next_gap(self, gap: float) -> float:
        """The time until the next render, after one `gap` seconds after the last (default: the same;
        `TextProgress` lengthens it)."""
        return gap

    def start(self, trainer: TrainerProtocol) -> None:
        """`fit()` starts (before the sanity check)."""

    def render(self, trainer: TrainerProtocol, force: bool = False) -> None:
        """Show the current state (throttled by the base class unless `force`: an epoch or a
        validation starts)."""

    def end_validation(self, trainer: TrainerProtocol) -> None:
        """A validation run (or the sanity check) ended; `val_label` is None again."""
        self.render(trainer, force=True)

    def end_epoch(self, trainer: TrainerProtocol) -> None:
        """A training epoch ended; the trainer prints its summary line next (`config.print_epoch_summary`)."""
        self.render(trainer, force=True)

    def stop(self, trainer: TrainerProtocol) -> None:
        """Training ended (or failed)."""


def _eta(done: int, total: int | None, rate: float) -> float:
    if total is None or rate <= 0:
        return float("inf")
    return max(0, total - done) / rate


def _validation_length(trainer: TrainerProtocol) -> int | None:
    """Batches the starting validation will run: the trainer's own limits, read from its config."""
    loader = trainer.val_loader
    if loader is None:
        return None
    total = 0
    for dl in as_loader_list(loader):  # several validation loaders run one after the other
        # As the trainer counts: `limit_val_batches`, and in the sanity check at most n of those.
        part = limited_length(dl, trainer.config.limit_val_batches, "limit_val_batches")
        n = trainer.config.num_sanity_val_steps
        if trainer.sanity_checking and n != -1:
            part = n if part is None else min(n, part)
        if part is None:
            return None
        total += part
    return total

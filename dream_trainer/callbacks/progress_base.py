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
from dream_trainer.utils.data import as_loader_list, limited_length

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class ProgressBarBase(Callback):
    """Counts batches and time on the hot path (an increment, a comparison and a clock read per batch)
    and calls `render()` at most every `refresh_seconds` (or every `batch_cadence()` batches, for a
    subclass that sets one); subclasses draw. Only global rank zero displays, and only during `fit()`.

    Training state: `batch` of `epoch_total` in the current epoch. Validation state (also the sanity
    check): `val_label` ("validation" or "sanity check", None when none runs), `val_batch` of `val_total`.
    """

    def __init__(self, refresh_seconds: float = 0.25) -> None:
        self.refresh_seconds = refresh_seconds
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
        self._enabled = False  # set at fit start: global rank zero displays

    # --- estimates --------------------------------------------------------------------------------
    def rate(self) -> float:
        """Training batches per second in this epoch so far."""
        elapsed = self.epoch_elapsed()
        return self.batch / elapsed if elapsed > 0 else 0.0

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
        self.batch = 0
        self.epoch_total = trainer.loop.epoch_length
        self._epoch_start = time.perf_counter()
        self._next_render = self._epoch_start + self.refresh_seconds
        self._cadence = self.batch_cadence()
        self._next_render_batch = self._cadence if self._cadence else float("inf")
        if self._enabled:
            self.render(trainer, force=True)

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch += 1
        now = time.perf_counter()
        if (now >= self._next_render or self.batch >= self._next_render_batch) and self._enabled:
            # "N batches or S seconds since the last render, whichever comes first"
            self._next_render = now + self.refresh_seconds
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
        self._next_render = self._val_start + self.refresh_seconds
        self.render(trainer, force=True)

    def on_validation_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.val_batch += 1
        now = time.perf_counter()
        if now >= self._next_render and self._enabled:
            self._next_render = now + self.refresh_seconds
            self.render(trainer)

    def on_validation_end(self, trainer: TrainerProtocol) -> None:
        if self._enabled and self.val_label is not None:
            self.val_label = None
            self.end_validation(trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        # The trainer prints the epoch summary right after this hook (see `end_epoch`).
        if self._enabled:
            self.end_epoch(trainer)

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        if self._enabled:
            self.stop(trainer)

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        if self._enabled:
            self.stop(trainer)

    # --- drawing (subclasses) ---------------------------------------------------------------------
    def batch_cadence(self) -> int | None:
        """Render every this many training batches as well as every `refresh_seconds` (None: time
        only). Asked at every epoch start, when `epoch_total` is known."""
        return None

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

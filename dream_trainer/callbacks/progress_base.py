"""ProgressBarBase: what every progress display counts and estimates; rendering is left to subclasses.

It reads only the trainer's public API (`num_training_batches`, `loop.epoch_length`, `global_step`,
`config`, ...). It does not depend on the concrete bars: `RichProgressBar` and `TextProgress` import
it, and the factory choosing between them, `default_progress_bar`, lives in `rich_progress`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


def format_duration(seconds: float) -> str:
    """`h:mm:ss` (or `m:ss` under an hour)."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):  # NaN or unknown
        return "?"
    s = max(0, int(seconds))  # a late estimate is "now", not negative
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_metrics(metrics: dict[str, float], limit: int = 6) -> str:
    """`name value` pairs of the first `limit` metrics, compactly."""
    items = list(metrics.items())[:limit]
    return "  ".join(f"{k} {v:.4g}" for k, v in items)


class ProgressBarBase(Callback):
    """Counts batches and time on the hot path (an increment and a clock read per batch) and calls
    `render()` at most every `refresh_seconds`; subclasses draw. Only global rank zero displays.
    """

    def __init__(self, refresh_seconds: float = 0.25) -> None:
        self.refresh_seconds = refresh_seconds
        self.batch = 0  # batches done in this epoch
        self.epoch_total: int | None = None
        self.run_total: float = float("inf")  # training steps the run will take
        self._next_render = 0.0
        self._epoch_start = 0.0
        self._enabled = True

    # --- estimates --------------------------------------------------------------------------------
    def rate(self) -> float:
        """Batches per second in this epoch so far."""
        elapsed = time.perf_counter() - self._epoch_start
        return self.batch / elapsed if elapsed > 0 else 0.0

    def epoch_eta(self) -> float:
        """Seconds until this epoch ends (inf when its length is unknown)."""
        rate = self.rate()
        if self.epoch_total is None or rate <= 0:
            return float("inf")
        return (self.epoch_total - self.batch) / rate

    def run_eta(self, trainer: TrainerProtocol) -> float:
        """Seconds until training ends, from this epoch's pace (steps, accumulation included)."""
        rate = self.rate() / trainer.config.gradient_accumulation_steps
        if rate <= 0 or self.run_total == float("inf"):
            return float("inf")
        return max(0.0, self.run_total - trainer.global_step) / rate

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
        if self._enabled:
            self.render(trainer, force=True)

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch += 1
        now = time.perf_counter()
        if now >= self._next_render and self._enabled:
            self._next_render = now + self.refresh_seconds
            self.render(trainer)

    def on_train_epoch_end(self, trainer: TrainerProtocol) -> None:
        if self._enabled:
            self.render(trainer, force=True)

    def on_train_end(self, trainer: TrainerProtocol) -> None:
        if self._enabled:
            self.stop(trainer)

    def on_exception(self, trainer: TrainerProtocol, exception: BaseException) -> None:
        if self._enabled:
            self.stop(trainer)

    # --- drawing (subclasses) ---------------------------------------------------------------------
    def start(self, trainer: TrainerProtocol) -> None:
        """Training starts."""

    def render(self, trainer: TrainerProtocol, force: bool = False) -> None:
        """Show the current state (throttled by the base class unless `force`)."""

    def stop(self, trainer: TrainerProtocol) -> None:
        """Training ended (or failed)."""

"""GarbageCollection: run Python's garbage collector on a fixed step cadence instead of at random."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class GarbageCollection(Callback):
    """Collect garbage every `every_n_steps` training steps, optionally with automatic collection off.

    Python's automatic collector starts whenever allocations cross a threshold, which in a training
    loop means random pauses mid-step (and, across processes, ranks pausing at different steps so the
    others wait for them). Collecting at known steps makes the pauses predictable and aligned.

    Args:
        every_n_steps: collect after every n-th training step (at the end of an accumulation window).
            None: never collect periodically (only sensible with the automatic collector on).
        generation: the generation to collect, 0, 1 or 2 (2 is a full collection).
        disable_automatic: turn the automatic collector off for the duration of training. At
            `on_train_start` the objects alive then (models, data, setup garbage collected first) are
            moved to the permanent generation with `gc.freeze()`, so later collections do not scan
            them again; the previous collector state is restored at `teardown`, also after a failure.
    """

    def __init__(self, every_n_steps: int | None = 100, generation: int = 2, disable_automatic: bool = False) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ConfigError(
                f"GarbageCollection(every_n_steps={every_n_steps!r}) is invalid: expected a positive integer or None"
            )
        if generation not in (0, 1, 2) or isinstance(generation, bool):
            raise ConfigError(f"GarbageCollection(generation={generation!r}) is invalid: valid choices are 0, 1, 2")
        self.every_n_steps = every_n_steps
        self.generation = generation
        self.disable_automatic = disable_automatic
        self._every = every_n_steps or 0
        self._restore: tuple[bool, bool] | None = None  # (was enabled, we froze) while we hold the collector

    def on_train_start(self, trainer: TrainerProtocol) -> None:
        if not self.disable_automatic or self._restore is not None:
            return
        was_enabled = gc.isenabled()
        froze = gc.get_freeze_count() == 0  # never unfreeze objects someone else froze
        if froze:
            gc.collect()
            gc.freeze()
        gc.disable()
        self._restore = (was_enabled, froze)

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._every and trainer.loop.step_ended_every(self._every):
            gc.collect(self.generation)

    def teardown(self, trainer: TrainerProtocol, stage: str) -> None:
        if self._restore is None:
            return
        was_enabled, froze = self._restore
        self._restore = None
        if froze:
            gc.unfreeze()
        if was_enabled:
            gc.enable()

"""BatchEndMixin: the end of a training batch, and the batch boundary after it.

A training batch ends in two parts. `on_train_batch_end` fires as soon as the batch's step is done
(`_batch_ended` marks it); the loop then runs the validation that step is due for (`val_every_n_steps`, or at an
epoch's last batch the epoch's); then, before the next batch is fetched, comes the *batch boundary*
(`_batch_boundary`): the work callbacks asked to run there (`trainer.at_batch_boundary(fn)`:
ModelCheckpoint's saves) runs, then a SIGTERM/SIGINT that arrived stops the run with a checkpoint. So
every checkpoint written between two batches holds one state: the weights that validation scored, and
the RNG state the next batch starts from, whatever the callbacks (in any order) and validation drew.
Written earlier, in `on_train_batch_end`, a file would be ranked by the previous validation and would
miss the draws of the callbacks listed after the one saving.

The default loop runs the boundary after each batch (`DreamTrainer._iter_train_batches`), after an
epoch's validation at its last batch (`_train_epoch_end`) and after `training_loop()`; a loop of the
user's own that calls `self.training_step` gets it when its next step starts. See
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dream_trainer.mixins.signals import SignalMixin


class BatchEndMixin(SignalMixin):
    """`on_train_batch_end`, `is_optimizer_step_end`, `at_batch_boundary` and the boundary itself."""

    def _init_batch_end(self) -> None:
        self._boundary_due: bool = False  # a batch ended and its boundary has not run yet
        self._boundary_work: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def _reset_batch_boundary(self) -> None:
        """At the start of every `fit()`: what an earlier `fit()` that failed asked for is dropped (a
        failure before the boundary, like a kill, leaves no file of that step)."""
        self._boundary_due = False
        self._boundary_work.clear()

    @property
    def is_optimizer_step_end(self) -> bool:
        """True when the running training batch completed an accumulation window: its training step is
        done (`global_step` advanced, the optimizers stepped unless the non-finite policy skipped them).
        Read it in `on_train_batch_end`, which fires for every micro-batch: True on the last one of each
        window only (every batch without accumulation). It stays True through the validation that step
        runs; False from the batch boundary on, and outside training."""
        return self._boundary_due and self._loop.window_pos == 0

    def at_batch_boundary(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` at the end of the running training batch: after every `on_train_batch_end`
        callback and after the validation this batch's step is due for, before the next batch starts.
        A checkpoint saved there (`trainer.at_batch_boundary(trainer.save_checkpoint, path)`) holds the
        validated weights and the RNG state the next batch starts from. Called when no training batch
        is ending (an epoch hook, outside `fit()`), it runs `fn` now. Requests run in order; one made
        by `fn` itself runs at once."""
        if self._boundary_due:
            self._boundary_work.append((fn, args))
        else:
            fn(*args)

    def _batch_ended(self) -> None:
        """The batch's step is done (`on_train_batch_end` fires next): its boundary is due."""
        self._boundary_due = True

    def _batch_boundary(self) -> None:
        """Between two training batches (see the module docstring); nothing when no batch ended since
        the last one, so the loop may call it wherever a boundary can fall."""
        if not self._boundary_due:
            return
        self._boundary_due = False
        if self._boundary_work:
            self._run_boundary_work()
        if self._signal_received is not None or self._agree_on_signals:
            self._check_signal()
        elif (watchdog := self._watchdog) is not None and watchdog.stop_requested:
            self._check_signal()  # a signal on another rank: its watchdog thread set stop_requested

    def _run_boundary_work(self) -> None:
        work = self._boundary_work
        while work:
            fn, args = work.pop(0)
            fn(*args)

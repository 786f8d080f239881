"""`LoopState`: where the training loop is. One object, one owner, one public API.

Its fields change through its own transition methods (`start_epoch`, `count_step`, `end_epoch`,
`resume`, ...), which the trainer's loop calls (the default `training_loop()`, the full training step,
the optimization verbs, a checkpoint being loaded, a tuning run); everything else reads it as
`trainer.loop`. The per-batch counters alone advance in place, on the hot path: `batch_idx` in
`DreamTrainer._iter_train_batches` and `batches_done` in `StepMixin._full_training_step` (a method call
there would cost more than the rest of the bookkeeping of a step). A callback asks
`trainer.loop.step_ended` ("did a training step, an accumulation window, just complete?") or
`trainer.loop.is_logging_step` instead of reaching for the trainer's private attributes.

The accumulation window is an object of its own (`dream_trainer.accumulation.AccumulationWindow`, which
alone changes it); the loop holds it to answer those questions, and shows where it is as `window_pos`,
`window_size` and `window_end` (read-only).

`trainer.global_step`, `trainer.current_epoch` and `trainer.batch_idx` are the same numbers as
`trainer.loop.global_step`, `.epoch` and `.batch_idx`.
"""

from __future__ import annotations

import copy
from typing import Any

from dream_trainer.accumulation import AccumulationWindow


class LoopState:
    """The loop's position. Read it anywhere; it changes through the transition methods below, which
    the trainer's loop calls (the per-batch counters advance in place: see the module docstring). The
    accumulation window's fields are read through it (`window_pos`, `window_size`, `window_end`, `window`).

    Attributes:
        epoch: the epoch being trained (0-based); after an epoch ends, the next one.
        global_step: completed training steps (accumulation windows), never optimizer calls.
        batch_idx: index of the current (or last) training batch within its epoch.
        window_pos: micro-batches begun in the current accumulation window (1-based while one runs);
            0 between steps. Read-only: the window's (`window`).
        window_size: micro-batches in the current window (`gradient_accumulation_steps`, fewer for
            the last window of an epoch). Read-only.
        window_end: the micro-batch being run completes its window (the optimizer steps after it).
            Read-only.
        epoch_length: batches in the current epoch after `limit_train_batches` (None: unknown).
        batches_done: batches of the current epoch whose step completed (what a resume skips).
        epoch_in_progress: between `on_train_epoch_start` and the end of `on_train_epoch_end`.
        epoch_exhausted: the epoch's batches are all done (its end hooks may still be running).
        skip_rest_of_epoch: an `on_train_batch_start` returned -1 (Lightning's signal): that batch and
            the rest of the epoch are not trained.
        epoch_unfinished: `fit()` returned inside this epoch (`max_steps` or `should_stop` before its last
            batch): it runs no more, and it has not ended (no `on_train_epoch_end`, `epoch` stays); its
            position (`batches_done`, the epoch's RNG) is where a checkpoint written now resumes.
        last_val_step: `global_step` at the last validation run (-1: none yet).
        log_every_n_steps: the logging cadence, from the config.
        max_steps: `config.max_steps`, or infinity.
    """

    __slots__ = (
        "_window",
        "batch_idx",
        "batches_done",
        "epoch",
        "epoch_exhausted",
        "epoch_in_progress",
        "epoch_length",
        "epoch_rng",
        "epoch_unfinished",
        "global_step",
        "last_val_step",
        "log_every_n_steps",
        "max_steps",
        "pending_resume",
        "skip_rest_of_epoch",
    )

    def __init__(
        self, log_every_n_steps: int = 1, max_steps: float = float("inf"), window: AccumulationWindow | None = None
    ) -> None:
        # The trainer's accumulation window (its own object: the loop only reads it).
        self._window = window if window is not None else AccumulationWindow()
        self.epoch = 0
        self.global_step = 0
        self.batch_idx = 0
        self.epoch_length: int | None = None
        self.batches_done = 0
        self.epoch_in_progress = False
        self.epoch_exhausted = False
        self.skip_rest_of_epoch = False
        self.epoch_unfinished = False
        self.last_val_step = -1
        self.log_every_n_steps = log_every_n_steps
        self.max_steps = max_steps
        # Private to the loop's resume logic: the RNG that drew this epoch's order, and the
        # mid-epoch position a checkpoint asked to continue from (applied when the epoch opens).
        self.epoch_rng: dict[str, Any] | None = None
        self.pending_resume: dict[str, Any] | None = None

    # --- transitions (the trainer's loop calls them; nothing else writes a field) ---------------------
    def start_epoch(self, epoch_length: int | None) -> None:
        """`on_train_epoch_start` is next: the epoch (of `epoch_length` batches, None: unknown) opens."""
        self.epoch_length = epoch_length
        self.epoch_in_progress = True
        self.epoch_exhausted = False
        self.skip_rest_of_epoch = False
        self.epoch_unfinished = False

    def take_resume(self) -> dict[str, Any] | None:
        """The mid-epoch resume record a checkpoint left (see `resume`), handed over once."""
        record, self.pending_resume = self.pending_resume, None
        return record

    def open_batches(self, start: int, epoch_rng: dict[str, Any] | None) -> None:
        """The epoch's iterator is open: `start` batches are already done (a mid-epoch resume), and
        `epoch_rng` drew the epoch's order (None: the loader keeps its own state)."""
        self.epoch_rng = epoch_rng
        self.batches_done = start

    def skip_epoch(self) -> None:
        """An `on_train_batch_start` returned -1: this batch and the rest of the epoch are not trained."""
        self.skip_rest_of_epoch = True

    def abandon_window(self) -> None:
        """A step raised inside a window (a tuner goes on with a new one): the next batch opens a window
        (`AccumulationWindow.discard`)."""
        self._window.discard()

    def count_step(self) -> None:
        """A training step (an accumulation window, its optimizer step done) completed."""
        self.global_step += 1

    def drop_batch(self) -> None:
        """A batch the loader yielded was dropped without a step (a skip list, a rolled-back spike): a
        resume's position counts it all the same."""
        self.batches_done += 1

    def finish_batches(self) -> None:
        """The epoch's batches are all done; its end hooks may still run."""
        self.epoch_exhausted = True

    def end_epoch(self) -> None:
        """The epoch's end hooks ran: the next epoch is the current one."""
        self.epoch_in_progress = False
        self.epoch += 1

    def leave_unfinished(self, record: dict[str, Any]) -> None:
        """`fit()` returns inside the epoch (`max_steps` or `should_stop` before its last batch): it runs no
        more, and has not ended. `record` is its position as a mid-epoch resume record (see `resume`): a
        later `fit()` of this trainer continues the epoch from it, as a new process would from a checkpoint."""
        self.epoch_in_progress = False
        self.epoch_unfinished = True
        self.pending_resume = record

    def validated(self) -> None:
        """A validation ran at this `global_step`."""
        self.last_val_step = self.global_step

    def set_epoch_length(self, epoch_length: int | None) -> None:
        """Batches in an epoch, once the training loader is (re)built."""
        self.epoch_length = epoch_length

    def set_cadence(self, log_every_n_steps: int, max_steps: float) -> None:
        """The logging cadence and the step limit (the config's; a tuning run lifts both)."""
        self.log_every_n_steps = log_every_n_steps
        self.max_steps = max_steps

    def move_to(self, *, global_step: int | None = None, epoch: int | None = None) -> None:
        """Set the counters (`trainer.global_step = n`, `trainer.current_epoch = n`)."""
        if global_step is not None:
            self.global_step = global_step
        if epoch is not None:
            self.epoch = epoch

    def resume(self, global_step: int, epoch: int, last_val_step: int, record: dict[str, Any] | None) -> None:
        """A checkpoint was loaded: continue at `global_step` in `epoch`; `record` is where in that epoch
        (batches done, the epoch's RNG, metrics), applied when the loop opens the epoch (the window a
        checkpoint was written in is the window's own entry, put back when it is loaded)."""
        self.global_step = global_step
        self.epoch = epoch
        self.last_val_step = last_val_step
        self.pending_resume = record
        self.epoch_unfinished = False

    # --- an exact copy (a tuning run puts it back) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every field, copied: `load_state_dict` of it puts the loop back exactly as it is now (the
        window, an object of its own, copies itself: `AccumulationWindow.snapshot`)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.__slots__ if name != "_window"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back the fields `state_dict()` returned (copies: the same state may be loaded again)."""
        for name in self.__slots__:
            if name in state and name != "_window":
                setattr(self, name, copy.deepcopy(state[name]))

    # --- the accumulation window (read-only here) ----------------------------------------------------
    @property
    def window(self) -> AccumulationWindow:
        """The accumulation window: its position, size and what ran in it (read it; the trainer changes it)."""
        return self._window

    @property
    def window_pos(self) -> int:
        """Micro-batches begun in the current accumulation window (1-based while one runs); 0 between steps."""
        return self._window.pos

    @property
    def window_size(self) -> int:
        """Micro-batches in the current window (`gradient_accumulation_steps`, fewer for an epoch's last)."""
        return self._window.size

    @property
    def window_end(self) -> bool:
        """The micro-batch being run completes its window (the optimizers step after it)."""
        return self._window.end

    # --- questions callbacks ask --------------------------------------------------------------------
    @property
    def step_ended(self) -> bool:
        """True between training steps: in `on_train_batch_end`, the batch just run completed an
        accumulation window (with `gradient_accumulation_steps=1`, every batch)."""
        return self._window.pos == 0

    @property
    def micro_batch(self) -> int:
        """1-based position of the running micro-batch in its window (0 between steps)."""
        return self._window.pos

    @property
    def is_logging_step(self) -> bool:
        """True when a step just ended and `global_step` is a multiple of `log_every_n_steps`: the
        moment the trainer reduces and writes its training metrics."""
        return self._window.pos == 0 and self.global_step % self.log_every_n_steps == 0

    def step_ended_every(self, n: int) -> bool:
        """True when a step just ended and `global_step` is a multiple of `n` (a callback's own cadence)."""
        return self._window.pos == 0 and self.global_step % n == 0

    @property
    def mid_epoch(self) -> bool:
        """Inside an epoch that has not ended: running and not all its batches done, or left unfinished by
        a stop. A checkpoint written now holds its position and resumes in it."""
        return (self.epoch_in_progress and not self.epoch_exhausted) or self.epoch_unfinished

    @property
    def max_steps_reached(self) -> bool:
        """`global_step` reached `config.max_steps`."""
        return self.global_step >= self.max_steps

    @property
    def resume_batch(self) -> int:
        """In `on_train_epoch_start` of the epoch a mid-epoch resume continues: the batches it skips
        (where its batches start); 0 otherwise."""
        resume = self.pending_resume
        if resume is None or resume.get("epoch") != self.epoch:
            return 0
        return int(resume.get("batches_done", 0))

    def __repr__(self) -> str:
        return (
            f"LoopState(epoch={self.epoch}, global_step={self.global_step}, batch_idx={self.batch_idx}, "
            f"window={self.window_pos}/{self.window_size}, epoch_length={self.epoch_length})"
        )

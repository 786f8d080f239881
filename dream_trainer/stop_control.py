"""StopControl: the batch boundary, where a training step commits, and the stop a signal asks for there.

A training batch ends in two parts. `on_train_batch_end` fires as soon as the batch's step is done
(`end_batch` marks its boundary due); the loop then runs the validation that step is due for
(`val_every_n_steps`, or at an epoch's last batch the epoch's); then, before the next batch is fetched,
comes the *batch boundary* (`boundary`): the work callbacks asked to run there
(`trainer.at_batch_boundary(fn)`: ModelCheckpoint's saves) runs, then a SIGTERM/SIGINT that arrived stops
the run with a checkpoint. So every checkpoint written between two batches holds one state: the weights
that validation scored, and the RNG state the next batch starts from, whatever the callbacks (in any
order) and validation drew. The default loop runs the boundary after each batch
(`DreamTrainer._iter_train_batches`), after an epoch's validation at its last batch (`_train_epoch_end`)
and after `training_loop()`; a loop of the user's own that calls `self.training_step` gets it when its
next step starts.

Signals: the handlers (SIGTERM, SIGINT and, in a SLURM job, `config.requeue_signal`) are installed for the
duration of `fit()` (main thread only: `install`) and restored after (`restore`). A handler only records the
signal; the boundary acts on it (with several ranks: at the step end they agree on through the watchdog's
store, `check`, so that all stop at the same step): the current batch finishes with its
`on_train_batch_end` callbacks and the validation its step is due for, the saves callbacks asked for there
are written, then the trainer's reaction runs (the `stop_on_signal` it was given: `CheckpointMixin` writes
a checkpoint synchronously, points `last.ckpt` to it, and raises `TrainingInterrupted`, a `SystemExit` with
code 128 + signal number). Rank zero prints one line on stderr: what stopped, the checkpoint, and how to
resume.

In a SLURM job the requeue signal (SIGUSR1 by default: `sbatch --requeue --signal=USR1@120`) saves in the
same way, then global rank zero requeues the job (`requeue_after_save`, which the reaction asks after the
save; `_requeue_announced` requeues it after the stop line, which the requeue would cut off) and the run
ends "requeued" (see docs/unattended.md). Slurm then ends the job's processes with SIGTERM: once requeued,
every rank ignores it, through the end of `fit()` and after (`restore`), so its teardown and exit finish (a
later SIGKILL, after Slurm's KillWait, still ends it). The process srun started must survive the requeue
signal to pass it on: `srun torchrun` without `--signals-to-handle=...,SIGUSR1` dies of it, and the first
line of the fit says so (`_check_launcher`).

A second SIGINT while the first waits for the batch to end stops at once, without a checkpoint (the run's
earlier checkpoints stay; the line says so). Once the checkpoint is being written, further signals only
print that the save is under way: the save is never abandoned half-written, and the run ends
"interrupted" as the first signal asked.

The trainer holds one (`DreamTrainer._init_stop_control`) and calls it at named places: `end_batch` and
`due`/`boundary` in the step and the loop, `install`/`settle`/`stop_before_training`/`restore` in `fit()`,
`defer` behind `trainer.at_batch_boundary` (`trainer.is_optimizer_step_end` reads `due`), `reset` at a
fit's start and a rollback. It knows nothing of the trainer: what it needs is given.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from dream_trainer.errors import TrainingInterrupted

if TYPE_CHECKING:
    from dream_trainer.config import DreamTrainerConfig
    from dream_trainer.loop_state import LoopState
    from dream_trainer.utils.watchdog_thread import Watchdog

_SIGNALS = (signal.SIGTERM, signal.SIGINT)

RequeueAfterSave = Callable[[int], "tuple[bool, str] | None"]
"""Asked by the reaction to a signal once its checkpoint is complete (`StopControl.requeue_after_save`)."""


class StopControl:
    """The batch boundary (its flag and the work deferred to it) and the signals acted on there."""

    __slots__ = (
        "_agree", "_config", "_distributed", "_global_zero", "_loop", "_previous_handlers", "_requeue_pending",
        "_requeued", "_stop_on_signal", "_stopping", "_told_to_wait", "_watchdog", "_work", "due", "signal_received",
    )  # fmt: skip

    def __init__(
        self,
        config: DreamTrainerConfig,
        loop: LoopState,
        stop_on_signal: Callable[[int, RequeueAfterSave], None],
    ) -> None:
        """`stop_on_signal(signum, requeue_after_save)`: the trainer's reaction, at a boundary once a signal
        arrived: save, then leave `fit()` by raising `TrainingInterrupted`."""
        self._config, self._loop, self._stop_on_signal = config, loop, stop_on_signal
        self.due: bool = False
        """A batch ended and its boundary has not run yet (read on the per-batch path; `end_batch` sets it)."""
        self._work: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.signal_received: int | None = None
        self._stopping: bool = False  # the checkpoint a signal asked for is being written
        self._told_to_wait: bool = False
        self._agree: bool = False  # the ranks agree with an all-reduce at logging points (no watchdog)
        self._distributed: bool = False
        self._global_zero: bool = True
        self._watchdog: Watchdog | None = None  # the fit's watchdog: the ranks agree to stop through its store
        self._previous_handlers: dict[int, Any] = {}
        self._requeue_pending: str | None = None  # the SLURM job to requeue once the stop line is out
        self._requeued = False  # the job is requeued (by rank zero): Slurm's SIGTERM to end this start is expected

    # --- the batch boundary ---------------------------------------------------------------------------
    def reset(self) -> None:
        """At the start of every `fit()`, and when a rollback undoes the steps that asked for work here
        (the replay asks again): what was asked for is dropped (a failure before the boundary, like a kill,
        leaves no file of that step)."""
        self.due = False
        self._work.clear()

    @property
    def has_work(self) -> bool:
        """Work waits for the boundary (a rollback must first undo what it would save)."""
        return bool(self._work)

    def defer(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """`trainer.at_batch_boundary(fn, *args)`: at the boundary of the batch ending, else now."""
        if self.due:
            self._work.append((fn, args))
        else:
            fn(*args)

    def end_batch(self) -> None:
        """The batch's step is done (`on_train_batch_end` fires next): its boundary is due."""
        self.due = True

    def boundary(self) -> None:
        """Between two training batches (see the module docstring); nothing when no batch ended since the
        last one, so the loop may call it wherever a boundary can fall."""
        if not self.due:
            return
        self.due = False
        if self._work:
            self._run_work()
        if self.signal_received is not None or self._agree:
            self.check()
        elif (watchdog := self._watchdog) is not None and watchdog.stop_requested:
            self.check()  # a signal on another rank: its watchdog thread set stop_requested

    def _run_work(self) -> None:
        work = self._work
        while work:
            fn, args = work.pop(0)
            fn(*args)

    # --- the signals of a fit ---------------------------------------------------------------------------
    def install(self, global_zero: bool) -> None:
        """The first thing `fit()` does: a signal during setup (building a large model, joining the process
        group, loading a checkpoint) is recorded, not fatal, and acted on once training can save
        (`stop_before_training`, or the first batch boundary)."""
        self.signal_received = None
        self._stopping = self._told_to_wait = False
        self._requeue_pending = None
        self._requeued = False
        self._agree = False  # decided once the process group exists (`settle`)
        self._watchdog = None
        self._global_zero = global_zero
        if not self._config.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        requeue_signals = self._requeue_signals()
        for sig in (*_SIGNALS, *requeue_signals):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        self._check_launcher(requeue_signals)

    def _check_launcher(self, requeue_signals: tuple[signal.Signals, ...]) -> None:
        """In a SLURM job step: the process srun started must survive the signals Slurm sends it (SIGTERM, the
        requeue signal), or it ends the step before the ranks save. `srun torchrun` without
        `--signals-to-handle=...,SIGUSR1` dies of SIGUSR1 at once (and Slurm signals torchrun only, not its
        ranks, on most clusters): global rank zero says so in one line, the first of the fit, with what to
        write instead (`dream_trainer.utils.slurm.launcher_hazard`)."""
        from dream_trainer.utils.slurm import launcher_hazard

        if not self._global_zero:
            return
        hazard = launcher_hazard((signal.SIGTERM, *requeue_signals))
        if hazard is not None:
            print(f"dream_trainer: {hazard}", file=sys.stderr, flush=True)

    def settle(self, distributed: bool, watchdog: Watchdog | None) -> None:
        """After setup (the process group) and the watchdog's start: how the ranks agree on a signal. Through
        the watchdog's store; without one, at logging points (`check`)."""
        self._distributed, self._watchdog = distributed, watchdog
        self._agree = self._config.handle_signals and distributed and watchdog is None

    def stop_before_training(self) -> None:
        """Just before `training_loop()`: a signal that arrived during setup. One process stops here, before
        its first step (the checkpoint holds the state it started from); several ranks agree on a step at
        the first batch boundaries, as for any signal (a rank's setup signal reaches the others there)."""
        if self.signal_received is not None and not self._distributed:
            self.check()

    def restore(self) -> None:
        """The end of `fit()`: the handlers it replaced are back; its watchdog is gone. After a requeue, SIGTERM
        and the requeue signal stay ignored instead: Slurm ends the requeued job's processes (SIGTERM, then
        SIGKILL after its KillWait), and the default action would cut off the rest of this process's exit
        (the caller's own code after `fit()`, the exit code 128 + signal number)."""
        self._watchdog = None
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, signal.SIG_IGN if self._requeued and sig != signal.SIGINT else handler)
        self._previous_handlers.clear()

    def signal_now(self) -> int | None:
        """The signal this process received (read by the watchdog's thread: a plain attribute, no lock)."""
        return self.signal_received

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_received is None:
            self.signal_received = signum  # acted on at the next batch boundary
            return
        if self._stopping:  # the checkpoint is being written (or fit() is ending): let it finish
            if not self._told_to_wait:
                self._told_to_wait = True
                self._say(f"{signal.Signals(signum).name} again: still writing the checkpoint, then stopping")
            return
        if signum == signal.SIGINT:  # a second Ctrl-C before the batch ended: stop now, without a checkpoint
            self._stopping = True
            stop = TrainingInterrupted(signum, None)
            self._say(stop.summary(self._loop.global_step))
            raise stop

    def _say(self, line: str) -> None:
        # From a signal handler: os.write, never print (the handler may run inside a print to stderr).
        if self._global_zero:
            os.write(2, f"dream_trainer: {line}\n".encode())

    def check(self) -> None:
        """At a batch boundary: stop if a signal arrived. With several ranks, all must stop at the same
        step: once a signal arrived on any rank, at the end of each step they ask the watchdog's store which
        step that is (`Watchdog.agreed_stop`: a step no rank has passed, within about two steps and one
        second of the signal); no rank pays anything per step before. Without a watchdog they agree with one
        small all-reduce at logging points."""
        watchdog = self._watchdog
        if watchdog is not None:
            if self._loop.window_pos:  # the ranks stop at a step's end, never inside an accumulation window
                return
            step = self._loop.global_step
            if step < watchdog.agreed_stop(self.signal_received, step):
                return
            signum = self.signal_received or watchdog.signal_number
            assert signum is not None  # an agreed stop names the signal
            self._stop(signum)
            return
        if not self._agree:
            if self.signal_received is not None:
                self._stop(self.signal_received)
            return
        if not self._loop.is_logging_step:
            return
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signal_received or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # SYNC: every rank, every log_every_n_steps
        if flag.item():
            self._stop(int(flag.item()))

    def _stop(self, signum: int) -> None:
        """Save and leave `fit()` (the trainer's `stop_on_signal`, which prints the stop line); then, when the
        requeue signal stopped a SLURM job, global rank zero requeues it: after the line, which a requeue
        would cut off (Slurm ends srun, which carries the job step's output to the log, within
        milliseconds)."""
        self.signal_received = signum
        self._stopping = True
        try:
            self._stop_on_signal(signum, self.requeue_after_save)
        except TrainingInterrupted as stop:
            self._requeue_announced(stop)
            raise

    def _requeue_announced(self, stop: TrainingInterrupted) -> None:
        """The stop line said the job is requeued (`scontrol show job` said it can be): requeue it now. If
        `scontrol requeue` fails after all, the stop is "interrupted" (run.json, the exit code's job state)
        and a second line says why."""
        from dream_trainer.utils.slurm import requeue

        job, self._requeue_pending = self._requeue_pending, None
        if job is None:
            return
        done, phrase = requeue(job, checked=True)
        self._requeued = done
        if not done:
            stop.requeue = (False, phrase)
            print(f"dream_trainer: {stop.summary(self._loop.global_step)}", file=sys.stderr, flush=True)

    # --- SLURM: the requeue signal -----------------------------------------------------------------
    def _requeue_signals(self) -> tuple[signal.Signals, ...]:
        """The signal `config.requeue_signal` names, in a SLURM job, when SIGTERM/SIGINT do not cover it
        (installed with them: it saves as they do; outside SLURM, SIGUSR1 keeps its default action)."""
        from dream_trainer.utils.slurm import job_id

        name = self._config.requeue_signal
        if name is None or job_id() is None:
            return ()
        sig = signal.Signals[name]
        return () if sig in _SIGNALS else (sig,)

    def requeue_after_save(self, signum: int) -> tuple[bool, str] | None:
        """After the checkpoint a signal asked for is complete on every rank: when that signal is
        `config.requeue_signal` in a SLURM job, whether the job can be requeued (`scontrol show job`), on
        global rank zero, which requeues it once the stop line is out (`_requeue_announced`). Returns
        `(requeued, the phrase for the stop line)`; None for any other signal or outside SLURM.

        Slurm then sends SIGTERM to every task and SIGKILL after its KillWait (30 s by default), while
        `fit()` ends (run.json "requeued", the loggers closed): the handler takes that SIGTERM in silence, and
        once `fit()` is over the process ignores it (`restore`)."""
        from dream_trainer.utils.slurm import can_requeue, job_id

        job, name = job_id(), self._config.requeue_signal
        if job is None or name is None or signum != signal.Signals[name]:
            return None
        self._told_to_wait = True  # the SIGTERM Slurm sends next is expected: no "still writing" line
        if not self._global_zero:  # one requeue per job; the other ranks only end as rank zero does
            self._requeued = True
            return True, f"requeued SLURM job {job} (by global rank 0)"
        can, phrase = can_requeue(job)
        self._requeue_pending = job if can else None
        return can, phrase

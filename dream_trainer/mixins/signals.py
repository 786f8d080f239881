"""SignalMixin: checkpoint-and-exit on SIGTERM/SIGINT (pre-emption, Ctrl-C).

The handler only records the signal; the loop acts on it at the next batch boundary (see
`dream_trainer.mixins.batch_end`; with several ranks: at the step end they agree on through the
watchdog's store, `_check_signal`, so that all stop at the same step), so the checkpoint holds the state
every checkpoint written between two batches holds: the current batch finishes with its
`on_train_batch_end` callbacks and the validation its step is due for, the saves callbacks asked for
there are written, then a checkpoint is written synchronously (earlier background writes are waited for,
nothing else), `last.ckpt` points to it, and `fit()` raises `TrainingInterrupted`, a `SystemExit` with
code 128 + signal number: hooks (`on_exception`, `teardown`) run on the way out and an uncaught exit
ends the process with that code.
Rank zero prints one line on stderr: what stopped, the checkpoint, and how to resume.

In a SLURM job the signal `config.requeue_signal` names (SIGUSR1 by default: `sbatch --requeue
--signal=USR1@120`) is handled too: it saves in the same way, then global rank zero requeues the job
(`_requeue_after_save` asks whether it can after the save; `_requeue_announced` requeues it after the
stop line, which the requeue would cut off) and the run ends "requeued" (see docs/unattended.md). The
process srun started must survive that signal to pass it on: `srun torchrun` without
`--signals-to-handle=...,SIGUSR1` dies of it, and the first line of the fit says so (`_check_launcher`).

A second SIGINT while the first waits for the batch to end stops at once, without a checkpoint (the
run's earlier checkpoints stay; the line says so). Once the checkpoint is being written, further
signals only print that the save is under way: the save is never abandoned half-written, and the
run ends "interrupted" as the first signal asked.

This mixin detects the signal (handlers, the flag, the ranks' agreement); the reaction, a checkpoint
and the exit, is `CheckpointMixin._stop_on_signal`, the template declared here. So this module needs
no checkpoint code, and `TrainingInterrupted` can be imported from it (callbacks do) cheaply. See
`dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from dream_trainer.errors import TrainingInterrupted  # defined there; importable from here as before
from dream_trainer.mixins.distributed import DistributedMixin

if TYPE_CHECKING:
    from dream_trainer.utils.watchdog import Watchdog

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalMixin(DistributedMixin):
    """Installs the handlers for the duration of `fit()` (main thread only) and restores them after."""

    _watchdog: Watchdog | None
    """The watchdog thread of a distributed `fit()` (owned by `WatchdogMixin`, the layer above): the
    ranks agree to stop through its store."""

    def _init_signals(self) -> None:
        self._signal_received: int | None = None
        self._stopping_on_signal: bool = False  # the checkpoint a signal asked for is being written
        self._told_to_wait: bool = False
        self._agree_on_signals: bool = False
        self._previous_handlers: dict[int, Any] = {}
        self._requeue_pending: str | None = None  # the SLURM job to requeue once the stop line is out

    def _install_signal_handlers(self) -> None:
        """The first thing `fit()` does: a signal during setup (building a large model, joining the
        process group, loading a checkpoint) is recorded, not fatal, and acted on once training can
        save (`_stop_before_training`, or the first batch boundary)."""
        self._signal_received = None
        self._stopping_on_signal = self._told_to_wait = False
        self._requeue_pending = None
        self._agree_on_signals = False  # decided once the process group exists (`_settle_signal_agreement`)
        if not self.config.handle_signals or threading.current_thread() is not threading.main_thread():
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

        if not self.is_global_zero:
            return
        hazard = launcher_hazard((signal.SIGTERM, *requeue_signals))
        if hazard is not None:
            print(f"dream_trainer: {hazard}", file=sys.stderr, flush=True)

    def _settle_signal_agreement(self) -> None:
        """After setup (the process group) and the watchdog's start: how the ranks agree on a signal.
        Without a watchdog (its store), at logging points (`_check_signal`)."""
        self._agree_on_signals = self.config.handle_signals and self.is_distributed and self._watchdog is None

    def _stop_before_training(self) -> None:
        """Just before `training_loop()`: a signal that arrived during setup. One process stops here, before
        its first step (the checkpoint holds the state it started from); several ranks agree on a step at
        the first batch boundaries, as for any signal (a rank's setup signal reaches the others there)."""
        if self._signal_received is not None and not self.is_distributed:
            self._check_signal()

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal_received is None:
            self._signal_received = signum  # acted on at the next batch boundary
            return
        if self._stopping_on_signal:  # the checkpoint is being written (or fit() is ending): let it finish
            if not self._told_to_wait:
                self._told_to_wait = True
                self._say(f"{signal.Signals(signum).name} again: still writing the checkpoint, then stopping")
            return
        if signum == signal.SIGINT:  # a second Ctrl-C before the batch ended: stop now, without a checkpoint
            self._stopping_on_signal = True
            stop = TrainingInterrupted(signum, None)
            self._say(stop.summary(self._loop.global_step))
            raise stop

    def _say(self, line: str) -> None:
        # From a signal handler: os.write, never print (the handler may run inside a print to stderr).
        if self.is_global_zero:
            os.write(2, f"dream_trainer: {line}\n".encode())

    def _check_signal(self) -> None:
        """At a batch boundary: stop if a signal arrived. With several ranks, all must stop at the
        same step: once a signal arrived on any rank, at the end of each step they ask the watchdog's
        store which step that is (`Watchdog.agreed_stop`: a step no rank has passed, within about two
        steps and one second of the signal); no rank pays anything per step before. Without a watchdog
        they agree with one small all-reduce at logging points."""
        watchdog = self._watchdog
        if watchdog is not None:
            if self._loop.window_pos:  # the ranks stop at a step's end, never inside an accumulation window
                return
            step = self._loop.global_step
            if step < watchdog.agreed_stop(self._signal_received, step):
                return
            self._signal_received = self._signal_received or watchdog.signal_number
            self._stop()
            return
        if not self._agree_on_signals:
            if self._signal_received is not None:
                self._stop()
            return
        if not self._loop.is_logging_step:
            return
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self._signal_received or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # SYNC: every rank, every log_every_n_steps
        if flag.item():
            self._signal_received = int(flag.item())
            self._stop()

    def _stop(self) -> None:
        """Save and leave `fit()` (`_stop_on_signal`, which prints the stop line); then, when the requeue
        signal stopped a SLURM job, global rank zero requeues it: after the line, which a requeue would cut
        off (Slurm ends srun, which carries the job step's output to the log, within milliseconds)."""
        self._stopping_on_signal = True
        try:
            self._stop_on_signal()
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
        if not done:
            stop.requeue = (False, phrase)
            print(f"dream_trainer: {stop.summary(self._loop.global_step)}", file=sys.stderr, flush=True)

    # --- SLURM: the requeue signal -----------------------------------------------------------------
    def _requeue_signals(self) -> tuple[signal.Signals, ...]:
        """The signal `config.requeue_signal` names, in a SLURM job, when SIGTERM/SIGINT do not cover it
        (installed with them: it saves as they do; outside SLURM, SIGUSR1 keeps its default action)."""
        from dream_trainer.utils.slurm import job_id

        name = self.config.requeue_signal
        if name is None or job_id() is None:
            return ()
        sig = signal.Signals[name]
        return () if sig in _SIGNALS else (sig,)

    def _requeue_after_save(self, signum: int) -> tuple[bool, str] | None:
        """After the checkpoint a signal asked for is complete on every rank: when that signal is
        `config.requeue_signal` in a SLURM job, whether the job can be requeued (`scontrol show job`), on
        global rank zero, which requeues it once the stop line is out (`_requeue_announced`). Returns
        `(requeued, the phrase for the stop line)`; None for any other signal or outside SLURM.

        Slurm then sends SIGTERM to every task and SIGKILL after its KillWait (30 s by default), while
        `fit()` ends (run.json "requeued", the loggers closed): the handler takes that SIGTERM in silence."""
        from dream_trainer.utils.slurm import can_requeue, job_id

        job, name = job_id(), self.config.requeue_signal
        if job is None or name is None or signum != signal.Signals[name]:
            return None
        self._told_to_wait = True  # the SIGTERM Slurm sends next is expected: no "still writing" line
        if not self.is_global_zero:  # one requeue per job; the other ranks only end as rank zero does
            return True, f"requeued SLURM job {job} (by global rank 0)"
        can, phrase = can_requeue(job)
        self._requeue_pending = job if can else None
        return can, phrase

    def _stop_on_signal(self) -> None:
        """Called at batch boundaries once a signal arrived: save, then leave `fit()` by raising
        `TrainingInterrupted`. Implemented by `CheckpointMixin`, the layer above this one."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot save on a signal: CheckpointMixin implements _stop_on_signal(); "
            "compose SignalMixin into a trainer that has CheckpointMixin (DreamTrainer does)."
        )

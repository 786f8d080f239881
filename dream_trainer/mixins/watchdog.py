"""WatchdogMixin: the hang watchdog of a distributed `fit()`, and the store the ranks agree to stop through.

While `fit()` runs on several processes, each runs a `dream_trainer.utils.watchdog_thread.Watchdog`
thread on the c10d store of the process group (torchrun's TCPStore): its hang watch
(`dream_trainer.utils.hang_watch`) ends the job, naming the stuck rank and where it is, when a rank
makes no progress for `config.hang_timeout` seconds (`hang_timeout_first_step` until the first
training step of the fit completes), and it carries the ranks' agreement to stop on a signal
(`dream_trainer.utils.stop_agreement`, asked by `SignalMixin._check_signal`) without a collective.
The watchdog's modules are imported, and its fork guard registered, when the first one starts. The main
thread only marks where it is (`_heartbeat`, `TrainerCore`'s); the training step marks it only while a
watchdog runs (`_step_marks`, set here when `fit()` starts and stops it). Global rank zero records the hang in
run.json through `RunDirectoryMixin._record_hang`. See docs/unattended.md and `dream_trainer.mixins.core`
for the layers.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.mixins.run_directory import RunDirectoryMixin
from dream_trainer.mixins.signals import SignalMixin

if TYPE_CHECKING:
    from dream_trainer.utils.watchdog_thread import Watchdog

# Each fit of a process gets keys of its own in the store: every rank runs the same fits in the same
# order, so the n-th fit of every rank uses the same prefix, and no key of an earlier fit is read.
_FITS = itertools.count()


class WatchdogMixin(RunDirectoryMixin, SignalMixin):
    """Starts the watchdog thread when `fit()` starts and stops it when `fit()` ends."""

    def _init_watchdog(self) -> None:
        self._watchdog: Watchdog | None = None
        # What the per-batch path marks (declared in TrainerCore): nothing while no watchdog reads it.
        self._step_marks = None

    def _watchdog_timeouts(self) -> tuple[float | None, float | None]:
        """(after, before) the first training step of the fit completed."""
        cfg = self.config
        first = cfg.hang_timeout_first_step
        if first is None and cfg.hang_timeout is not None:
            first = 3 * cfg.hang_timeout
        return cfg.hang_timeout, first

    def _watchdog_store(self) -> tuple[Any, int, int] | None:
        """(store, rank, world size) the watchdog talks through: the process group's store, on several
        processes; None on one (nothing to watch: a hang there is in plain view, and a debugger's
        prompt must not end the run)."""
        import torch.distributed as dist

        if not self.is_distributed or not dist.is_initialized():
            return None
        # The store the default group was built on (torchrun's TCPStore, or the one init_process_group made):
        # torch has no public accessor for it. Should that private one go, a client of the TCPStore the
        # launcher's environment names (MASTER_ADDR/MASTER_PORT: torchrun's, or the one rank zero hosts).
        get_default = getattr(dist.distributed_c10d, "_get_default_store", None)
        if get_default is not None:
            return get_default(), self.global_rank, self.world_size
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        return store, self.global_rank, self.world_size

    def _start_watchdog(self) -> None:
        """Start of `fit()`, once the process group exists (before the signal handlers are installed, so
        that they know the ranks agree through it)."""
        hang, first = self._watchdog_timeouts()
        if hang is None and first is None and not self.config.handle_signals:
            return
        found = self._watchdog_store()
        if found is None:
            return
        import torch.distributed as dist

        from dream_trainer.utils.watchdog_thread import Watchdog

        store, rank, world = found
        self._watchdog = Watchdog(
            dist.PrefixStore(f"dream_trainer/watchdog/{next(_FITS)}/", store),
            rank,
            world,
            self._heartbeat,
            global_step=self._global_step_now,
            local_signal=self._signal_now,
            hang_timeout=hang,
            first_step_timeout=first,
            stacks_dir=self._stacks_dir,
            on_hang=self._record_hang if rank == 0 else None,
            end_process=self._end_process,
        )
        self._step_marks = self._heartbeat  # from now on the training step says where it is
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        """End of `fit()`, before run.json records how it ended (a verdict cannot overwrite that)."""
        watchdog, self._watchdog = self._watchdog, None
        self._step_marks = None
        if watchdog is not None:
            watchdog.close()

    # What the watchdog's thread reads of the main thread: plain attributes, never a lock.
    def _global_step_now(self) -> int:
        return self._loop.global_step

    def _signal_now(self) -> int | None:
        return self._signal_received

    def _stacks_dir(self) -> Path:
        return self._run_dir if self._run_dir is not None else Path(os.fspath(self.config.root_dir))

    def _end_process(self, code: int) -> None:
        """How the watchdog ends a hung process: at once, whatever its main thread is doing (blocked in
        a collective, ignoring SIGTERM)."""
        os._exit(code)

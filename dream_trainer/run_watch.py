"""RunWatch: the hang watchdog of a distributed `fit()`, started and stopped with it.

While `fit()` runs on several processes, each runs a `dream_trainer.utils.watchdog_thread.Watchdog` thread
on the c10d store of the process group (torchrun's TCPStore): its hang watch
(`dream_trainer.utils.hang_watch`) ends the job, naming the stuck rank and where it is, when a rank makes
no progress for `config.hang_timeout` seconds (`hang_timeout_first_step` until the first training step of
the fit completes), and it carries the ranks' agreement to stop on a signal
(`dream_trainer.utils.stop_agreement`, asked by `StopControl.check`, which `start`'s watchdog is handed to)
without a collective. The watchdog's modules are imported, and its fork guard registered, when the first
one starts. The main thread only marks where it is (the trainer's `_heartbeat`); the training step marks it
only while a watchdog runs (the trainer's `_step_marks`, set from what `start` returns). Global rank zero
records the hang in run.json (the `record_hang` it is given). See docs/unattended.md.

The trainer holds one (`DreamTrainer._init_run_watch`), and `fit()` calls `start` once the process group
exists and `stop` as it ends. It knows nothing of the trainer: what it needs is given.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dream_trainer.config import DreamTrainerConfig
    from dream_trainer.loop_state import LoopState
    from dream_trainer.utils.heartbeat import Heartbeat
    from dream_trainer.utils.watchdog_thread import Watchdog

# Each fit of a process gets keys of its own in the store: every rank runs the same fits in the same
# order, so the n-th fit of every rank uses the same prefix, and no key of an earlier fit is read.
_FITS = itertools.count()

Found = tuple[Any, int, int]
"""(store, rank, world size) the watchdog talks through."""


def process_group_store(rank: int, world_size: int) -> Found | None:
    """The store the default process group was built on (torchrun's TCPStore, or the one
    init_process_group made), with this process's rank and the world size; None before the group exists.
    torch has no public accessor for it: should that private one go, a client of the TCPStore the
    launcher's environment names (MASTER_ADDR/MASTER_PORT: torchrun's, or the one rank zero hosts)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    get_default = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_default is not None:
        return get_default(), rank, world_size
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    return store, rank, world_size


class RunWatch:
    """Starts the watchdog thread when `fit()` starts and stops it when `fit()` ends."""

    __slots__ = (
        "_config", "_end_process", "_find_store", "_local_signal", "_loop", "_record_hang",
        "_stacks_dir", "watchdog",
    )  # fmt: skip

    def __init__(
        self,
        config: DreamTrainerConfig,
        loop: LoopState,
        *,
        find_store: Callable[[], Found | None],
        local_signal: Callable[[], int | None],
        stacks_dir: Callable[[], Path],
        record_hang: Callable[[dict[str, Any]], None],
        end_process: Callable[[int], None],
    ) -> None:
        """`find_store()`: (store, rank, world size) on several processes, None on one (nothing to watch: a
        hang there is in plain view, and a debugger's prompt must not end the run). `local_signal()`: the
        signal this process received. `stacks_dir()`: where a hang's stacks go. `record_hang(report)`: on
        global rank zero, the verdict in run.json. `end_process(code)`: how a hung process ends."""
        self._config, self._loop = config, loop
        self._find_store, self._local_signal, self._stacks_dir = find_store, local_signal, stacks_dir
        self._record_hang, self._end_process = record_hang, end_process
        self.watchdog: Watchdog | None = None

    def timeouts(self) -> tuple[float | None, float | None]:
        """(after, before) the first training step of the fit completed."""
        cfg = self._config
        first = cfg.hang_timeout_first_step
        if first is None and cfg.hang_timeout is not None:
            # Capped: a verdict later than the process group's timeout would come after a collective failed.
            first = min(3 * cfg.hang_timeout, cfg.process_group_timeout)
        return cfg.hang_timeout, first

    def start(self, heartbeat: Heartbeat) -> Watchdog | None:
        """Start of `fit()`, once the process group exists: the watchdog started, reading `heartbeat` (where
        the main thread is), or None (one process, or nothing to watch for)."""
        hang, first = self.timeouts()
        if hang is None and first is None and not self._config.handle_signals:
            return None
        found = self._find_store()
        if found is None:
            return None
        import torch.distributed as dist

        from dream_trainer.utils.watchdog_thread import Watchdog

        store, rank, world = found
        watchdog = self.watchdog = Watchdog(
            dist.PrefixStore(f"dream_trainer/watchdog/{next(_FITS)}/", store),
            rank,
            world,
            heartbeat,
            global_step=self._global_step_now,
            local_signal=self._local_signal,
            hang_timeout=hang,
            first_step_timeout=first,
            stacks_dir=self._stacks_dir,
            on_hang=self._record_hang if rank == 0 else None,
            end_process=self._end_process,
        )
        watchdog.start()
        return watchdog

    def stop(self) -> None:
        """End of `fit()`, before run.json records how it ended (a verdict cannot overwrite that)."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.close()

    # What the watchdog's thread reads of the main thread: plain attributes, never a lock.
    def _global_step_now(self) -> int:
        return self._loop.global_step

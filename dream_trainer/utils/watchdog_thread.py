"""One rank's watchdog thread: it carries the hang verdict and the ranks' stop agreement, out of band.

Each rank of a distributed fit runs one daemon thread (`Watchdog`) that talks to the other ranks through
the c10d store the process group was built on (torchrun's TCPStore), never through a collective. It
carries two protocols, each in a module of its own that owns its state:

- the hang verdict (`dream_trainer.utils.hang_watch.HangWatch`): no mark for the timeout raises an
  alarm, one rank judges, the stuck ranks are named and the job ends;
- the agreement to stop together on a signal (`dream_trainer.utils.stop_agreement.StopAgreement`):
  the main thread's side of it (`stop_requested`, read at each step end, and `agreed_stop`) is this
  class's, inherited, so that the step end's test stays one plain attribute read.

One thread ticks both, every `tick` seconds, because they share one store (`dream_trainer.utils.watch_store`)
and its bell: one counter, incremented by every write the other ranks must see, so a tick makes one store
request whatever each protocol waits for, and each looks at its own keys only when the bell rang. A thread
per protocol would double the requests of a quiet run, and each would poll the same counter.

Cost: a tick every `tick` seconds (0.5 s; more with over 500 ranks) makes one store request, and one
more every few seconds to publish the heartbeat (the last known place of a rank that stops
answering). The first watchdog to start registers the fork guard (`watch_store.guard_forks`); nothing is
registered before. Nothing here knows about the trainer: `dream_trainer.run_watch` runs it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.utils.hang_watch import HangWatch
from dream_trainer.utils.stop_agreement import StopAgreement
from dream_trainer.utils.watch_store import WatchStore, guard_forks

if TYPE_CHECKING:
    from dream_trainer.utils.heartbeat import Heartbeat


class Watchdog(StopAgreement):
    """One rank's watchdog thread (see the module): its stop agreement (inherited: `stop_requested`,
    `signal_number`, `agreed_stop`) and its hang watch (`hang`), ticked by one thread.

    Args:
        store: a c10d store every rank reaches, under a prefix of its own for this fit.
        heartbeat: what the main thread marks.
        global_step: the main thread's completed training steps.
        local_signal: the signal this process got (None: none).
        hang_timeout, first_step_timeout: seconds without a mark before a hang is declared, after
            and before the first training step of the fit completed (None: not watched then).
        stacks_dir: where the stacks file goes (the run directory), read when it is written.
        on_hang: called with the verdict before the job ends, by global rank zero only (run.json).
        end_process: ends the process with the code (`os._exit`).

    The thread whose stack a hang report reads is the one that builds the watchdog (the main thread).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        heartbeat: Heartbeat,
        *,
        global_step: Callable[[], int],
        local_signal: Callable[[], int | None],
        hang_timeout: float | None,
        first_step_timeout: float | None,
        stacks_dir: Callable[[], Path],
        on_hang: Callable[[dict[str, Any]], None] | None = None,
        end_process: Callable[[int], None] = os._exit,
        grace: float = 3.0,
        tick: float | None = None,
    ) -> None:
        shortest = min((t for t in (hang_timeout, first_step_timeout) if t is not None), default=None)
        if tick is None:
            # 0.5 s, slower with many ranks (one store request per tick and rank), faster for short timeouts.
            tick = max(0.5, world_size / 1000)
            if shortest is not None:
                tick = min(tick, shortest / 4)
        self.tick = tick
        shared = WatchStore(store)
        super().__init__(shared, world_size, heartbeat, global_step, tick)
        self.hang = HangWatch(
            shared,
            rank,
            world_size,
            heartbeat,
            global_step=global_step,
            hang_timeout=hang_timeout,
            first_step_timeout=first_step_timeout,
            stacks_dir=stacks_dir,
            on_hang=on_hang,
            end_process=end_process,
            grace=grace,
            tick=tick,
        )
        self._watch_store = shared  # the bell each tick reads
        self._local_signal = local_signal
        self._bell_seen = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dream_trainer-watchdog", daemon=True)

    @property
    def verdict(self) -> dict[str, Any] | None:
        """The hang verdict this rank carried out (None: none)."""
        return self.hang.verdict

    # --- the main thread ----------------------------------------------------------------------------
    def start(self) -> None:
        guard_forks()  # before this thread's first store request
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the end of the fit). A verdict being carried out goes on: it ends the process."""
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(1.0, 2 * self.tick))
        if not self._thread.is_alive():
            self.hang.disarm()

    # --- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.hang.begin()
        except Exception:
            return  # the store is gone already: the job is ending
        while not self._closed.wait(self.tick):
            try:
                self._tick()
            except Exception:
                # The store is gone: its host ended. The job is ending (see `HangWatch.on_store_lost`).
                self.hang.on_store_lost()
                return

    def _tick(self) -> None:
        now = time.monotonic()
        hang = self.hang
        hang.observe(now)
        signum = self._local_signal()
        if signum is not None:
            self.publish_signal(signum)
        bell = self._watch_store.bell()
        if bell != self._bell_seen:
            self._bell_seen = bell
            self._on_bell()
        if hang.raise_alarm_if_overdue(now):
            self._on_bell()
        hang.publish_heartbeat_if_due(now)

    def _on_bell(self) -> None:
        self.answer_if_asked()
        self.hang.on_bell()

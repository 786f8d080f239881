"""The ranks' agreement to stop together on a signal, out of band, through the c10d store.

A signal may reach one rank only, or reach the others while they wait in a collective (a Python signal
handler runs only once it returns), yet every rank must stop at the same step end. One rank's side of
the agreement (`StopAgreement`), carried by its watchdog thread (`dream_trainer.utils.watchdog_thread`):

- A rank that got a signal sets a key (`publish_signal`, the first signal of any rank stays) and rings
  the bell (`dream_trainer.utils.watch_store`). Every rank's thread reads the bell each tick and, on
  seeing the key (`answer_if_asked`), sets `stop_requested` (read by the main thread at each step end)
  and answers with the latest step its main thread can still be stopped at.
- The ranks stop together at the largest answer (`agreed_stop`, where the main thread waits): a step no
  rank has passed, reached within about one or two steps plus two ticks of the signal, with no
  collective and no store request on the steps of a run that got none.

The hang watch (`dream_trainer.utils.hang_watch`) counts a main thread waiting in `agreed_stop` as
waiting for the other ranks, as in a collective. Nothing here knows about the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dream_trainer.utils.heartbeat import Heartbeat
    from dream_trainer.utils.watch_store import WatchStore

# Keys under the fit's prefix.
_SIGNAL = "signal"  # the first signal any rank got
_ANSWERS = "stop/answers"  # how many ranks answered the signal
_LATEST = "stop/latest"  # the largest answer: the step every rank stops at
_STOP = "stop/step"  # set once every rank answered


class StopAgreement:
    """One rank's side of the agreement to stop on a signal (see the module).

    The watchdog's thread calls `publish_signal` (this rank's signal) and `answer_if_asked` (the bell
    rang); the main thread reads `stop_requested` at each step end and, once a signal is pending on some
    rank, calls `agreed_stop`.

    Args:
        store: the fit's store, shared with the hang watch.
        world_size: how many ranks answer.
        heartbeat: what the main thread marks (it marks that it waits for the agreement).
        global_step: the main thread's completed training steps.
        tick: how often the watchdog's thread looks at the bell (seconds).
    """

    def __init__(
        self,
        store: WatchStore,
        world_size: int,
        heartbeat: Heartbeat,
        global_step: Callable[[], int],
        tick: float,
    ) -> None:
        self._store, self._world = store, world_size
        self._heartbeat, self._global_step = heartbeat, global_step
        self._answer_wait = 4 * tick  # for every rank's thread to see the signal and answer
        # Written by the watchdog's thread, read by the main thread at each step end (a plain attribute).
        self.stop_requested = False
        self.signal_number: int | None = None
        # Written by the main thread: the step end it waits at for the agreement.
        self._waiting_at: int | None = None
        self._agreed: int | None = None
        self._published_signal = False

    # --- the main thread ----------------------------------------------------------------------------
    def agreed_stop(self, own_signal: int | None, step: int, timeout: float = 60.0) -> int:
        """At the end of global step `step`, once a signal is pending on some rank (`own_signal`, or
        `stop_requested`): the global step every rank stops at (>= `step`), agreed through the store.
        Waits here, at most `timeout` seconds more than every rank's thread needs to answer."""
        if self._agreed is not None:
            return self._agreed
        if own_signal is not None:
            self.publish_signal(own_signal)
        self._heartbeat.mark("agreeing on a stop after a signal")
        self._waiting_at = step  # the thread's answer may be this step (see `_answer_signal`)
        deadline = time.monotonic() + timeout + self._answer_wait
        store = self._store
        while not store.check([_STOP]):
            if time.monotonic() > deadline:
                answered = store.add(_ANSWERS, 0)
                raise TimeoutError(
                    f"only {answered} of {self._world} ranks answered the stop a signal asked for within "
                    f"{timeout:g} s: a rank is stuck (the hang watchdog names it: config.hang_timeout) or gone"
                )
            time.sleep(0.01)
        self._agreed = int(store.get(_STOP))
        self._waiting_at = None
        if self.signal_number is None:
            self.signal_number = int(store.get(_SIGNAL))
        return self._agreed

    # --- either thread ------------------------------------------------------------------------------
    def publish_signal(self, signum: int) -> None:
        """This rank got `signum`: every rank is to stop (once; the first signal of any rank stays)."""
        if not self._published_signal:
            self._published_signal = True
            self._store.compare_set(_SIGNAL, "", str(signum))
            self._store.ring()

    # --- the watchdog's thread ----------------------------------------------------------------------
    def answer_if_asked(self) -> None:
        """The bell rang: answer a signal of any rank, once."""
        if not self.stop_requested and self._store.check([_SIGNAL]):
            self._answer_signal()

    def _answer_signal(self) -> None:
        """A rank got a signal: from now on the main thread checks at every step end (`stop_requested`,
        set first), so it stops at the latest at the step end after the one it is in now; answer that."""
        self.signal_number = int(self._store.get(_SIGNAL))
        self.stop_requested = True
        waiting = self._waiting_at
        latest = waiting if waiting is not None else self._global_step() + 1
        self._store.cas_max(_LATEST, latest)
        if self._store.add(_ANSWERS, 1) == self._world:  # the last answer: every rank's is in
            self._store.set(_STOP, self._store.get(_LATEST))
            self._store.ring()

"""The hang watchdog of a distributed run, and the ranks' agreement to stop on a signal: its names.

A collective cannot tell that a rank is stuck: it waits with the stuck rank. So each rank runs one
daemon thread that talks to the other ranks through the c10d store the process group was built on
(torchrun's TCPStore), never through a collective. Its pieces, one concern per module:

- `dream_trainer.utils.heartbeat`: where the main thread is (`Heartbeat`), all the main thread writes.
- `dream_trainer.utils.hang_watch`: the hang verdict (`HangWatch`): the alarm, the reports, the stuck
  ranks named, their stacks written, the job ended; what the verdict says (`judge`, `describe`,
  `HANG_EXIT_CODE`) in `dream_trainer.utils.hang_verdict`.
- `dream_trainer.utils.stop_agreement`: the ranks' agreement to stop together on a signal
  (`StopAgreement`: `stop_requested`, `agreed_stop`).
- `dream_trainer.utils.watch_store`: what both share: the store's requests under the fork guard, and
  the bell.
- `dream_trainer.utils.watchdog_thread`: the thread that ticks both (`Watchdog`).

This module gives their public names: `Heartbeat` at once (the trainer's core holds one), the others on
first use (`__getattr__`), so that `import dream_trainer` loads none of the watchdog's code and registers
no fork hook (the first watchdog to start does). Nothing here knows about the trainer:
`dream_trainer.run_watch` runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dream_trainer.utils.heartbeat import Heartbeat

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers and editors
    from dream_trainer.utils.hang_verdict import HANG_EXIT_CODE, describe, judge, main_thread_state
    from dream_trainer.utils.watchdog_thread import Watchdog

__all__ = ["HANG_EXIT_CODE", "Heartbeat", "Watchdog", "describe", "judge", "main_thread_state"]

_LAZY = frozenset(__all__) - {"Heartbeat"}


def __getattr__(name: str) -> Any:
    """A name of the watchdog's modules, imported on first use and kept in this module."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from dream_trainer.utils import hang_verdict, watchdog_thread

    value = getattr(watchdog_thread if name == "Watchdog" else hang_verdict, name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

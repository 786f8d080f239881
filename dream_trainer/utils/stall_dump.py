"""The stacks of a rank whose Python threads cannot run at all: C code holding the GIL.

The watchdog (`dream_trainer.utils.watchdog_thread`) is a Python thread: when the main thread is stuck inside C
code that holds the GIL (a C extension's loop, a blocking call made without releasing it), that thread
never runs again. It cannot report, write the rank's stacks or end the process, and the process ignores
SIGTERM (Python's handler needs the GIL too), so the launcher waits for its own SIGKILL timeout.

`faulthandler` has a thread of its own, in C, that needs no GIL. While the watchdog runs, each of its
ticks re-arms `faulthandler.dump_traceback_later` a little past the moment the other ranks reach their
verdict on this one; the timer fires only if no tick came for that long. It then writes every thread's
Python stack to a pending file in the run directory (`.hang-stacks-rank<R>-<host>-<pid>.pending`) and ends
the process at once (exit status 1), so the launcher names this rank and stops the job. A healthy rank
that judged it turns the pending file into `hang-stacks-rank<R>.txt` (`collect_stacks`), with the
verdict's line on top, as for any stuck rank.

A stopped process (SIGSTOP, a debugger) runs no thread at all, this one neither: its timer never fires. A
healthy rank on its host reads it stopped from /proc, promises no stacks for it, ends it with SIGKILL and
removes its pending file (`dream_trainer.utils.hang_watch`, reading /proc with
`dream_trainer.utils.process_state`).

`faulthandler.dump_traceback_later` has one timer per process: a program that uses it for itself loses
its own timer while a distributed `fit()` runs (set `hang_timeout=None` to keep it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import time
from pathlib import Path
from typing import IO


def pending_name(rank: int, host: str, pid: int) -> str:
    return f".hang-stacks-rank{rank}-{host}-{pid}.pending"


_PENDING_RE = re.compile(r"^\.hang-stacks-rank(\d+)-(.+)-(\d+)\.pending$")  # a host name may hold "-"


def parse_pending_name(name: str) -> tuple[int, str, int] | None:
    """`(rank, host, pid)` of a `pending_name`, or None for any other name. A process killed outright
    (SIGKILL) leaves its pending file behind; the run's next process removes it once that pid is gone
    (`dream_trainer.utils.run_dirs.remove_stray_files`)."""
    m = _PENDING_RE.match(name)
    return None if m is None else (int(m.group(1)), m.group(2), int(m.group(3)))


class StallDump:
    """One process's armed `faulthandler` timer and the pending file it writes to (see the module)."""

    def __init__(self, rank: int, host: str) -> None:
        self._name = pending_name(rank, host, os.getpid())
        self._file: IO[str] | None = None
        self._directory: Path | None = None
        self._armed = False

    def arm(self, directory: Path, after: float) -> None:
        """From the watchdog's thread, every tick: the stacks are written and the process ends if no
        further call comes within `after` seconds."""
        if directory != self._directory:
            self._close()
            self._directory = directory
            with contextlib.suppress(OSError):  # not there yet (another rank creates the run directory)
                self._file = open(directory / self._name, "w")  # noqa: SIM115 (kept open for the C thread)
        if self._file is None:
            return
        faulthandler.dump_traceback_later(after, repeat=False, file=self._file, exit=True)
        self._armed = True

    def disarm(self) -> None:
        """The watchdog handles a hang itself, or the fit ended: no timer, no pending file."""
        if self._armed:
            faulthandler.cancel_dump_traceback_later()
            self._armed = False
        self._close()
        self._directory = None

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            with contextlib.suppress(OSError):
                os.unlink(self._file.name)
            self._file = None


def collect_stacks(directory: Path, rank: int, host: str, pid: int, header: str, wait: float) -> bool:
    """On a healthy rank, once the verdict named `rank` as stuck and not responding: wait up to `wait`
    seconds for the stuck process's timer to fire (its pending file fills, then stops growing), then write
    `hang-stacks-rank<R>.txt` (the header, then the stacks) and remove the pending file. False when
    nothing came (another node's disk, or the process was not stuck in C)."""
    pending = directory / pending_name(rank, host, pid)
    deadline = time.monotonic() + wait
    size = -1
    while time.monotonic() < deadline:
        now = pending.stat().st_size if pending.exists() else 0
        if now and now == size:  # written, and no longer growing
            break
        size = now
        time.sleep(0.1)
    else:
        return False
    text = pending.read_text(errors="replace")
    target = directory / f"hang-stacks-rank{rank}.txt"
    partial = directory / f".{target.name}.partial"
    partial.write_text(
        f"{header}\n\n"
        "(written by faulthandler's own thread: no Python thread of this rank could run, so it was stuck in C "
        "code holding the GIL; it ended with exit status 1)\n\n" + text
    )
    os.replace(partial, target)
    with contextlib.suppress(OSError):
        pending.unlink()
    return True

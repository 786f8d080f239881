"""What /proc (Linux) tells of a process on this host: when it started, and whether it is stopped.

The hang watchdog (`dream_trainer.utils.hang_watch`) reads a silent rank this way: a stopped process (SIGSTOP,
SIGTSTP, a debugger) runs no thread at all, so it can neither write its stacks nor end itself, and SIGTERM
waits until it is continued. A pid alone does not name a process (pids are reused, and another PID namespace
on the same host name has its own): its start time, read with it, does.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _stat_fields(path: str) -> list[str]:
    """/proc's `stat` line after the name ("pid (name) S ..."; the name may hold spaces and parentheses):
    [0] is the state, [19] the start time (clock ticks after boot)."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def process_start(pid: int | str = "self") -> str | None:
    """When process `pid` started (/proc, Linux): with its pid, it names the process (a pid is reused, and
    another PID namespace on the same host name has its own); None where /proc cannot say."""
    try:
        return _stat_fields(f"/proc/{pid}/stat")[19]
    except (OSError, IndexError):
        return None


def process_state(pid: int, start: str | None = None) -> str | None:
    """What /proc (Linux) tells of process `pid` on this host (`start`: the `process_start` it must have):
    "stopped" when every thread of it is (SIGSTOP, SIGTSTP, a debugger: none runs, faulthandler's neither),
    "uninterruptible" when its main thread waits in the kernel (state D: a read or write that has not
    returned), "gone" when it ended (or that pid is another process now), else "running". None where /proc
    cannot say (another system)."""
    states = []
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return "gone" if os.path.isdir("/proc/self/task") else None
    except OSError:
        return None
    for thread in threads:
        with contextlib.suppress(OSError, IndexError):  # a thread that ended meanwhile
            states.append((thread.name, _stat_fields(str(thread / "stat"))[0]))
    main = dict(states).get(str(pid))
    if main is None or main in "ZX" or (start is not None and process_start(pid) != start):
        return "gone"
    if all(state in "Tt" for _, state in states):
        return "stopped"
    return "uninterruptible" if main == "D" else "running"

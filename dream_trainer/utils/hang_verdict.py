"""What a hang verdict says: which ranks are stuck, and the one line that names each.

Functions of what the ranks reported (`dream_trainer.utils.hang_watch` gathers the reports and carries
the verdict out): `main_thread_state` reads a rank's main thread from its Python stack, `judge` names
the stuck ranks, `describe` writes a rank's part of the verdict's line; and what a stuck rank leaves:
its stacks (`write_stacks`) and why it fails, for torchrun (`write_error_file`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import sysconfig
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

HANG_EXIT_CODE = 124
"""The exit status of every rank the watchdog ends (the `timeout` command's)."""

_UTILS = os.path.dirname(os.path.abspath(__file__))
_WAITING_IN = (  # a main thread whose innermost Python frame is here waits for the other ranks
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}autograd{os.sep}",  # DDP's gradient all-reduce runs inside backward
    f"torch{os.sep}nn{os.sep}parallel{os.sep}",
    os.path.join(_UTILS, "stop_agreement.py"),  # `StopAgreement.agreed_stop`: the ranks agreeing on a stop
)
# Python up to 3.11.7 (CPython gh-112275): a child forked while another thread holds the interpreter's
# thread-list lock inherits it held and hangs before running any Python code. A rank whose loader worker
# hung so waits for its first batch forever (seen at an epoch's start under DDP).
_FORK_DEADLOCKS = sys.version_info < (3, 11, 8)
_WORKER_DEADLOCK = (
    f"on Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro} a DataLoader worker can "
    "deadlock as it starts (CPython gh-112275, fixed in 3.11.8): upgrade Python, or give the loader "
    "multiprocessing_context='forkserver'"
)
_LIBRARY = (f"{os.sep}torch{os.sep}", f"{os.sep}dream_trainer{os.sep}utils{os.sep}")
_STDLIB = sysconfig.get_paths()["stdlib"]


def main_thread_state(frame: FrameType | None) -> tuple[bool, str]:
    """(waiting in a collective, "function (file:line)" of the innermost frame of the user's code).

    A rank blocked in a collective has its innermost frame in torch.distributed or the autograd engine;
    a stuck one anywhere else (the user's code, a DataLoader queue, a file write)."""
    if frame is None:
        return False, "?"
    waiting = any(p in frame.f_code.co_filename for p in _WAITING_IN)
    at: str | None = None
    f: FrameType | None = frame
    while f is not None:  # the innermost frame outside Python's library, torch and these utilities
        name = f.f_code.co_filename
        stdlib = name.startswith(_STDLIB) and "site-packages" not in name
        if not stdlib and not any(p in name for p in _LIBRARY) and not name.startswith("<"):
            at = f"{f.f_code.co_name} ({os.path.basename(name)}:{f.f_lineno})"
            break
        f = f.f_back
    if at is None:
        at = f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
    return waiting, at


def judge(reports: Mapping[int, Mapping[str, Any]], missing: list[int]) -> list[int]:
    """The stuck ranks: those that did not report (their watchdog thread cannot run), else the ranks
    furthest behind (`Heartbeat.position`), and among those, the ones not waiting in a collective."""
    if missing:
        return sorted(missing)
    lowest = min(tuple(r["position"]) for r in reports.values())
    behind = [rank for rank, r in reports.items() if tuple(r["position"]) == lowest]
    busy = [rank for rank in behind if not reports[rank]["waiting"]]
    return sorted(busy or behind)


def describe(rank: int, report: Mapping[str, Any] | None) -> str:
    """`rank 1: training_step at global step 5, 31 s without progress [in sleepy (train.py:40)]`."""
    if report is None:
        return f"rank {rank}: not responding (nothing known of it)"
    state = report.get("state")
    if state == "stopped":  # where it was is its last heartbeat's (a few seconds old): how long it idled is not
        return (
            f"rank {rank}: frozen (stopped, by SIGSTOP or a debugger; last seen: {report['where']} at global step "
            f"{report['step']}; no stacks can come from it; rank {report['read_by']} ends it with SIGKILL)"
        )
    text = f"rank {rank}: {report['where']} at global step {report['step']}, {report['idle']:.0f} s without progress"
    if report.get("at"):
        text += f" [in {report['at']}]"
    if report.get("silent"):
        text += " (not responding; its last heartbeat"
        if state == "uninterruptible":  # where to look; its faulthandler thread is not in D: its stacks come
            text += "; its main thread in uninterruptible I/O, state D"
        elif state is None and "host" in report:
            text += f"; no rank that answers can read its state on {report['host']}"
        text += ")"
    if report["where"] == "fetching batch" and _FORK_DEADLOCKS:
        text += f" ({_WORKER_DEADLOCK})"
    return text


def write_error_file(path: str, message: str, stack: str, when: float) -> None:
    """A torchrun error file: its report shows `message`, then `stack`, as the rank's traceback."""
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": f"{message}\n{stack}", "timestamp": str(int(when))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then names the exit code only


def write_stacks(directory: Path, rank: int, line: str, main_frame: FrameType | None) -> None:
    """The Python stacks of every thread of this process, in `hang-stacks-rank<R>.txt` under the verdict's
    `line`; and the main thread's (`main_frame`), with the verdict, in torchrun's error file (its report
    shows them)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"hang-stacks-rank{rank}.txt", "w") as f:
            f.write(f"dream_trainer: {line}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError as exc:
        print(f"dream_trainer: could not write the stacks of rank {rank}: {exc}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        stack = "".join(traceback.format_stack(main_frame)) if main_frame is not None else ""
        write_error_file(error_file, f"HangDetected: {line}", stack, time.time())

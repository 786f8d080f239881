"""A pytest plugin: every process a test run starts ends with it, or the run fails naming it.

The run's own process puts a mark in its environment before anything starts (`pytest_configure`): every
process the run starts inherits it (xdist's workers, torchrun and its ranks, loader workers, fork servers,
servers, Slurm's daemons and jobs), as `helpers.launcher_free_env` copies the environment. When the run ends,
a process that still carries the mark outlived its test: it is named, ended, and the run fails. A pytest
started by a test marks its own processes afresh and checks them itself. `tests/conftest.py` loads it
(`pytest_plugins`); `pytest -p process_check` loads it alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import pytest

SESSION_MARK = "DREAM_TRAINER_TEST_SESSION"
# xdist's workers, and what they started last, are still exiting when the run ends: they get this long.
GRACE_S = float(os.environ.get("DREAM_TRAINER_TEST_PROCESS_GRACE", "20"))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's own process (xdist's controller): mark what it starts
        os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"


def _stop_own_service_processes() -> None:
    """multiprocessing's fork server and resource tracker of this process (a test that used multiprocessing
    started them) end when it exits; they are ended now, so they are not taken for leftovers.
    (Under xdist they are the workers', which have exited by now.)"""
    from multiprocessing import forkserver, resource_tracker

    for service in (forkserver._forkserver, resource_tracker._resource_tracker):
        with contextlib.suppress(Exception):
            service._stop()


def _marked_processes(mark: str) -> dict[int, str]:
    """The processes whose environment holds `SESSION_MARK=mark`, but this one: pid -> command line."""
    needle = f"{SESSION_MARK}={mark}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    mark = os.environ.get(SESSION_MARK)
    if hasattr(config, "workerinput") or mark is None or not os.path.isdir("/proc"):
        return
    _stop_own_service_processes()
    deadline = time.monotonic() + GRACE_S
    left = _marked_processes(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _marked_processes(mark)
    if not left:
        return
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    lines = "\n".join(f"  pid {pid}: {command[:300]}" for pid, command in sorted(left.items()))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    text = f"{len(left)} process(es) the test run started outlived it (now killed):\n{lines}"
    if reporter is not None:
        reporter.write_line(text, red=True)
    else:
        print(text, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

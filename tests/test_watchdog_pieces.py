"""The watchdog's pieces on their own (`dream_trainer.utils.watchdog` names them): the fork guard of the store
they share, registered by the first watchdog to start and never by `import dream_trainer`; the stop agreement
without the thread or the hang watch; the names given on first use. The watchdog at work: tests/test_watchdog.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dream_trainer.utils.heartbeat import Heartbeat


def test_a_fork_waits_until_the_watchdog_thread_leaves_its_store_request() -> None:
    # A DataLoader forking its workers while the watchdog thread was inside a store request left a worker
    # deadlocked at its start (the child inherits locks held by a thread it does not have).
    from dream_trainer.utils import watch_store

    inside, release = threading.Event(), threading.Event()

    class SlowStore:  # a store request in flight until `release`
        def add(self, key: str, amount: int) -> int:
            inside.set()
            release.wait(5)
            return 0

    def tick() -> None:  # the watchdog thread's store, as the watchdog wraps it
        watch_store.WatchStore(SlowStore()).bell()

    watch_store.guard_forks()  # as the first watchdog to start does
    thread = threading.Thread(target=tick)
    thread.start()
    inside.wait(5)
    threading.Timer(0.5, release.set).start()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child can take the guard: it is not inherited held
        os._exit(0 if watch_store.FORK_GUARD.acquire(timeout=2) else 1)
    waited = time.monotonic() - start
    _, status = os.waitpid(pid, 0)
    thread.join()
    assert waited >= 0.4  # the fork waited for the request to end
    assert os.waitstatus_to_exitcode(status) == 0


# The watchdog's code: `import dream_trainer` loads none of it (`dream_trainer.utils.watchdog` gives its names
# on first use; `Heartbeat` is in `dream_trainer.utils.heartbeat`).
WATCHDOG_MODULES = [
    "dream_trainer.utils.hang_verdict",
    "dream_trainer.utils.hang_watch",
    "dream_trainer.utils.process_state",
    "dream_trainer.utils.stop_agreement",
    "dream_trainer.utils.watch_store",
    "dream_trainer.utils.watchdog",
    "dream_trainer.utils.watchdog_thread",
]


def test_import_registers_no_fork_hook_the_first_watchdog_to_start_does_once() -> None:
    # The fork guard's at-fork hook is process-wide: a program that never starts a watchdog must not get it.
    # Hooks cannot be listed, so the probe records who calls `os.register_at_fork`.
    probe = f"""
import json, os, sys
from pathlib import Path
calls = []
register = os.register_at_fork
def spy(**hooks):
    calls.append(sys._getframe(1).f_code.co_filename)
    register(**hooks)
os.register_at_fork = spy
import dream_trainer
package = os.path.dirname(dream_trainer.__file__)
ours = lambda: [os.path.relpath(f, package) for f in calls if f.startswith(package)]
names = sys.modules.get("dream_trainer.utils.watchdog")
out = {{"import": ours(), "loaded": [m for m in {WATCHDOG_MODULES!r} if m in sys.modules],
       "named": sorted(vars(names)) if names else []}}
at_import = len(ours())
import torch.distributed as dist
from dream_trainer.utils.watchdog import Heartbeat, Watchdog
out["started"] = []
for _ in range(2):
    w = Watchdog(dist.HashStore(), 0, 1, Heartbeat(), global_step=lambda: 0, local_signal=lambda: None,
                 hang_timeout=None, first_step_timeout=None, stacks_dir=Path.cwd, end_process=lambda code: None)
    w.start()
    w.close()
    out["started"].append(ours()[at_import:])
print(json.dumps(out))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    # Nothing is registered at import: the run lock's hook (a forked DataLoader worker drops the run's flock)
    # comes with the first lock a process takes, the watchdog's with the first watchdog.
    assert out["import"] == [] and out["loaded"] == [], out
    assert "Watchdog" not in out["named"] and "judge" not in out["named"], out  # loaded, if at all, as names only
    guard = os.path.join("utils", "watch_store.py")
    assert out["started"] == [[guard], [guard]], out  # the first start registers it; the second, nothing more


def test_the_watchdogs_names_are_given_on_first_use() -> None:
    from dream_trainer.utils import hang_verdict, heartbeat, watchdog, watchdog_thread

    assert watchdog.Heartbeat is heartbeat.Heartbeat and watchdog.Watchdog is watchdog_thread.Watchdog
    assert watchdog.judge is hang_verdict.judge and watchdog.HANG_EXIT_CODE == hang_verdict.HANG_EXIT_CODE == 124
    assert set(watchdog.__all__) <= set(dir(watchdog))
    with pytest.raises(AttributeError, match="has no attribute 'Watchdg'"):
        watchdog.Watchdg  # noqa: B018


def test_the_stop_agreement_needs_no_thread_and_no_hang_watch() -> None:
    # The agreement owns its state: two ranks' sides on one store, driven by hand as their watchdog threads
    # would (publish a signal; on the bell, answer). Rank 0 is at step 3, rank 1 at step 4: both stop at 5.
    from dream_trainer.utils.stop_agreement import StopAgreement
    from dream_trainer.utils.watch_store import WatchStore

    store = WatchStore(dist.PrefixStore("fit0/", dist.HashStore()))
    steps = [3, 4]
    ranks = [StopAgreement(store, 2, Heartbeat(), lambda rank=rank: steps[rank], tick=0.05) for rank in (0, 1)]
    ranks[0].publish_signal(signal.SIGTERM)
    assert store.bell() == 1 and not ranks[1].stop_requested
    for rank in ranks:
        rank.answer_if_asked()
    assert all(r.stop_requested and r.signal_number == signal.SIGTERM for r in ranks)
    assert store.bell() == 2  # the last answer rang: the step is agreed
    assert [r.agreed_stop(None, step) for r, step in zip(ranks, steps, strict=True)] == [5, 5]

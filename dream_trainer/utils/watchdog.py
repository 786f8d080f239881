"""The hang watchdog of a distributed run, and the ranks' agreement to stop on a signal, out of band.

A collective cannot tell that a rank is stuck: it waits with the stuck rank. So each rank runs one
daemon thread (`Watchdog`) that talks to the other ranks through the c10d store the process group
was built on (torchrun's TCPStore), never through a collective:

- The main thread only records where it is (`Heartbeat.mark`: two attribute stores, no I/O). The
  thread notices when the marks stop: no mark for `hang_timeout` seconds (`first_step_timeout` until
  the first training step of the fit completes) raises an alarm in the store. Every rank then reports
  where it is: its last mark, its global step, how far it went (`Heartbeat.position`), how long it
  has made no progress, and whether its main thread waits inside a collective (read from its Python
  stack). One rank judges (`judge`): the ranks furthest behind are stuck (the others wait for them
  in the next collective), preferring, among equals, those not waiting in a collective. Every rank
  prints the one line of the verdict; each stuck rank writes the Python stacks of all its threads to
  `hang-stacks-rank<R>.txt` in the run directory (`faulthandler`) and tells torchrun why it fails
  (`TORCHELASTIC_ERROR_FILE`); global rank zero records "hung" in run.json; then the stuck ranks
  end at once and the others a moment later (`HANG_EXIT_CODE`), so torchrun names a stuck rank as
  the root cause. The thread ends its process with `os._exit`: a main thread that ignores SIGTERM or
  waits forever inside a collective ends too. Files are written atomically (a temporary name, then
  a rename), so a save cut short leaves a hidden partial file, never a torn checkpoint.
- A stuck rank that does not report is read by a rank that answers on its host (`process_state`, from
  /proc): one that is stopped (SIGSTOP, a debugger) runs no thread at all, so it can neither write its
  stacks nor end itself, and SIGTERM waits until it is continued. The verdict says so, promises no
  stacks for it, and the rank that read it ends it with SIGKILL (`_end_frozen`) before ending itself.
- A rank that got a signal sets a key; every thread polls one counter (the "bell") per tick and, on
  seeing the key, sets `stop_requested` (read by the main thread at each step end) and answers with
  the latest step its main thread can still be stopped at. The ranks stop together at the largest
  answer (`agreed_stop`): a step no rank has passed, reached within about one or two steps plus two
  ticks of the signal, with no collective and no store request on the steps of a run that got none.

Cost: a tick every `tick` seconds (0.5 s; more with over 500 ranks) makes one store request, and one
more every few seconds to publish the heartbeat (the last known place of a rank that stops
answering). Nothing here knows about the trainer: `dream_trainer.mixins.watchdog` runs it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from dream_trainer.utils.process_state import process_start, process_state
from dream_trainer.utils.stall_dump import StallDump, collect_stacks, pending_name

HANG_EXIT_CODE = 124
"""The exit status of every rank the watchdog ends (the `timeout` command's)."""
_AFTER_SILENT_EXIT = 1.0  # seconds a healthy rank waits once every stuck rank ended (see _act)

_WAITING_IN = (  # a main thread whose innermost Python frame is here waits for the other ranks
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}autograd{os.sep}",  # DDP's gradient all-reduce runs inside backward
    f"torch{os.sep}nn{os.sep}parallel{os.sep}",
    os.path.abspath(__file__),  # `agreed_stop`: the ranks agreeing on a stop
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

# Keys under the fit's prefix.
# A fork (a DataLoader starting its workers) never happens while the watchdog thread is inside a store
# request: the child would inherit the store client's locks held by a thread it does not have, and a loader
# worker deadlocked at its start (seen under load: the main thread waiting for its workers' first answer).
# Each store request holds this lock (`_ForkSafeStore`); a fork takes it first and both sides release it after.
_FORK_GUARD = threading.Lock()
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(
        before=_FORK_GUARD.acquire, after_in_parent=_FORK_GUARD.release, after_in_child=_FORK_GUARD.release
    )

_BELL = "bell"  # incremented by every write the other ranks must see
_SIGNAL = "signal"  # the first signal any rank got
_ANSWERS = "stop/answers"  # how many ranks answered the signal
_LATEST = "stop/latest"  # the largest answer: the step every rank stops at
_STOP = "stop/step"  # set once every rank answered
_ALARM = "hang/alarm"  # the rank that raised it: it judges
_REPORTS = "hang/reports"
_VERDICT = "hang/verdict"
_RECORDED = "hang/recorded"  # global rank zero wrote run.json
_PROBE = "hang/probe"  # {rank: [host, pid, start]} of silent ranks: a responding rank on that host reads each
_STATE = "hang/state/"  # + rank: what a rank on its host read of a silent rank's process (`process_state`)


class Heartbeat:
    """Where this process's main thread is: `where` (a hook, a step, "fetching batch", ...), `marks`
    (every mark counts one) and `batches` (training batches started). Written by the main thread on
    the hot path, read by the watchdog thread."""

    __slots__ = ("batch_mark", "batches", "marks", "where")

    def __init__(self) -> None:
        self.where = "setup"
        self.marks = 0
        self.batches = 0
        self.batch_mark = 0  # `marks` when the running batch started

    def mark(self, where: str) -> None:
        self.where = where
        self.marks += 1

    def start_batch(self, where: str) -> None:
        """A training batch starts (every rank starts the same batches, in the same order)."""
        self.where = where
        self.marks += 1
        self.batches += 1
        self.batch_mark = self.marks

    def position(self) -> tuple[int, int]:
        """How far the main thread went: batches started, marks since. Every rank passes the same marks
        in the same order, so a rank with a smaller position is behind."""
        return self.batches, self.marks - self.batch_mark


def _cas_max(store: Any, key: str, value: int) -> None:
    """`store[key] = max(store[key], value)`, atomically (compare-and-set until it holds)."""
    current = store.compare_set(key, "", str(value)).decode()
    while int(current) < value:
        current = store.compare_set(key, current, str(value)).decode()


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


class Watchdog:
    """One rank's watchdog thread (see the module docstring).

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
        main_thread: the thread whose stack is read (the one that started the watchdog).
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
        self._store = _ForkSafeStore(store)
        self._rank, self._world = rank, world_size
        self._heartbeat = heartbeat
        self._global_step, self._local_signal = global_step, local_signal
        self._hang_timeout, self._first_step_timeout = hang_timeout, first_step_timeout
        self._stacks_dir, self._on_hang, self._end_process = stacks_dir, on_hang, end_process
        self._grace = grace
        shortest = min((t for t in (hang_timeout, first_step_timeout) if t is not None), default=None)
        if tick is None:
            # 0.5 s, slower with many ranks (one store request per tick and rank), faster for short timeouts.
            tick = max(0.5, world_size / 1000)
            if shortest is not None:
                tick = min(tick, shortest / 4)
        self.tick = tick
        self._heartbeat_every = max(5.0, tick)
        self._report_wait = max(3.0, 4 * tick)  # for every rank to answer an alarm (6 ticks)
        self._main_ident = threading.get_ident()
        self._host = socket.gethostname()
        self._start, self._error_file = process_start(), os.environ.get("TORCHELASTIC_ERROR_FILE")
        # A main thread stuck in C holding the GIL starves this thread: faulthandler's own thread then
        # writes the stacks and ends the process (armed each tick, see dream_trainer.utils.stall_dump).
        self._stall = StallDump(rank, self._host)
        self._next_arm = 0.0  # when the stall timer is re-armed next
        self._armed_for: float | None = None  # the timeout it was armed for (first step's, then hang_timeout)
        # Written by this thread, read by the main thread at each step end.
        self.stop_requested = False
        self.signal_number: int | None = None
        # Written by the main thread: the step end it waits at for the agreement.
        self._waiting_at: int | None = None
        self._agreed: int | None = None
        self._published_signal = False
        self.verdict: dict[str, Any] | None = None
        self._bell_seen = 0
        self._alarmed = self._reported = self._acted = self._probed = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dream_trainer-watchdog", daemon=True)

    # --- the main thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the end of the fit). A verdict being carried out goes on: it ends the process."""
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(1.0, 2 * self.tick))
        if not self._thread.is_alive():
            with _FORK_GUARD:
                self._stall.disarm()

    def agreed_stop(self, own_signal: int | None, step: int, timeout: float = 60.0) -> int:
        """At the end of global step `step`, once a signal is pending on some rank (`own_signal`, or
        `stop_requested`): the global step every rank stops at (>= `step`), agreed through the store.
        Waits here, at most `timeout` seconds more than every rank's thread needs to answer."""
        if self._agreed is not None:
            return self._agreed
        if own_signal is not None:
            self._publish_signal(own_signal)
        self._heartbeat.mark("agreeing on a stop after a signal")
        self._waiting_at = step  # this thread's answer may be this step (see `_answer_signal`)
        deadline = time.monotonic() + timeout + 4 * self.tick
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

    def _publish_signal(self, signum: int) -> None:
        if not self._published_signal:
            self._published_signal = True
            self._store.compare_set(_SIGNAL, "", str(signum))  # the first signal of any rank stays
            self._store.add(_BELL, 1)

    # --- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        self._last_marks = self._heartbeat.marks
        self._last_progress = self._next_heartbeat = time.monotonic()
        self._start_step = self._global_step()
        self._first_done = False
        try:  # at once: what the others know of this rank if it never ticks again (stuck in C from the start)
            self._publish_heartbeat(self._last_progress)
            self._arm_stall()
        except Exception:
            return  # the store is gone already: the job is ending
        self._next_heartbeat = self._last_progress + self._heartbeat_every
        while not self._closed.wait(self.tick):
            try:
                self._tick()
            except Exception:
                # The store is gone: its host ended (under srun, global rank zero hosts it, and may end its
                # fit first). The job is ending; a hang being handled ends this process as it would have.
                if self._alarmed:
                    self._finish(self.verdict)
                return

    def _tick(self) -> None:
        now = time.monotonic()
        hb = self._heartbeat
        if hb.marks != self._last_marks:
            self._last_marks, self._last_progress = hb.marks, now
        if not self._first_done and self._global_step() != self._start_step:
            self._first_done = True
        self._arm_stall()
        timeout = self._hang_timeout if self._first_done else self._first_step_timeout
        signum = self._local_signal()
        if signum is not None:
            self._publish_signal(signum)
        bell = self._store.add(_BELL, 0)
        if bell != self._bell_seen:
            self._bell_seen = bell
            self._on_bell()
        if timeout is not None and not self._alarmed and now - self._last_progress > timeout:
            self._alarmed = True
            with _FORK_GUARD:  # this thread handles the hang: its waits below must not fire the timer
                self._stall.disarm()
            self._store.compare_set(_ALARM, "", str(self._rank))  # the first rank to raise it judges
            self._store.add(_BELL, 1)
            self._on_bell()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self._heartbeat_every
            self._publish_heartbeat(now)

    def _publish_heartbeat(self, now: float) -> None:
        # With when this process started (what names it with its pid, `process_state`) and torchrun's error file: a
        # rank that ends this one, stopped, gives torchrun the verdict through it.
        report = {**self._report(now, with_stack=False), "start": self._start, "error_file": self._error_file}
        self._store.set(f"heartbeat/{self._rank}", json.dumps(report))

    def _arm_stall(self) -> None:
        """Every few ticks: if no tick comes for longer than the other ranks take to judge this one,
        faulthandler writes this process's stacks and ends it (`dream_trainer.utils.stall_dump`). Each arm
        replaces faulthandler's timer thread, so it is done at most every `interval` seconds (the timer
        allows for that), and never while a fork is under way (`_FORK_GUARD`): a child must not inherit a
        timer half replaced."""
        timeout = self._hang_timeout if self._first_done else self._first_step_timeout
        if timeout is None or self._alarmed:
            return
        now = time.monotonic()
        interval = min(5.0, max(self.tick, timeout / 2))
        if now < self._next_arm and timeout == self._armed_for:
            return
        self._next_arm, self._armed_for = now + interval, timeout
        directory = self._stacks_dir()
        with _FORK_GUARD:
            self._stall.arm(directory, timeout + self._report_wait + 1.0 + interval)

    def _on_bell(self) -> None:
        store = self._store
        if not self.stop_requested and store.check([_SIGNAL]):
            self._answer_signal()
        if not self._reported and store.check([_ALARM]):
            self._reported = True
            self._alarmed = True  # one alarm per fit
            with _FORK_GUARD:
                self._stall.disarm()
            store.set(f"hang/report/{self._rank}", json.dumps(self._report(time.monotonic(), with_stack=True)))
            store.add(_REPORTS, 1)
            if int(store.get(_ALARM)) == self._rank:
                self._judge()
        if self._reported and not self._probed and store.check([_PROBE]):
            self._probed = True
            self._probe(json.loads(store.get(_PROBE)))
        if not self._acted and store.check([_VERDICT]):
            self._act(json.loads(store.get(_VERDICT)))

    def _answer_signal(self) -> None:
        """A rank got a signal: from now on the main thread checks at every step end (`stop_requested`,
        set first), so it stops at the latest at the step end after the one it is in now; answer that."""
        self.signal_number = int(self._store.get(_SIGNAL))
        self.stop_requested = True
        waiting = self._waiting_at
        latest = waiting if waiting is not None else self._global_step() + 1
        _cas_max(self._store, _LATEST, latest)
        if self._store.add(_ANSWERS, 1) == self._world:  # the last answer: every rank's is in
            self._store.set(_STOP, self._store.get(_LATEST))
            self._store.add(_BELL, 1)

    def _report(self, now: float, with_stack: bool) -> dict[str, Any]:
        hb = self._heartbeat
        report: dict[str, Any] = {
            "where": hb.where,
            "step": self._global_step(),
            "position": list(hb.position()),
            "idle": round(now - self._last_progress, 1),
            "host": self._host,
            "pid": os.getpid(),
        }
        if with_stack:
            report["waiting"], report["at"] = main_thread_state(sys._current_frames().get(self._main_ident))
        return report

    def _judge(self) -> None:
        """The rank that raised the alarm: collect every rank's report, name the stuck ones."""
        store = self._store
        deadline = time.monotonic() + self._report_wait
        while store.add(_REPORTS, 0) < self._world and time.monotonic() < deadline:
            time.sleep(0.05)
        reports: dict[int, dict[str, Any]] = {}
        for rank in range(self._world):
            if store.check([f"hang/report/{rank}"]):
                reports[rank] = json.loads(store.get(f"hang/report/{rank}"))
        missing = [rank for rank in range(self._world) if rank not in reports]
        stuck = judge(reports, missing)
        hosts = {report.get("host") for report in reports.values()}  # where a rank answers
        silent: dict[int, str | None] = {}  # those on such a host, and when their process started
        for rank in missing:  # what is known of a rank that does not answer: its last heartbeat
            if store.check([f"heartbeat/{rank}"]):
                seen = json.loads(store.get(f"heartbeat/{rank}"))
                start, _ = seen.pop("start", None), seen.pop("error_file", None)  # not for the verdict, nor run.json
                reports[rank] = {**seen, "silent": True}
                if seen.get("host") in hosts and "pid" in seen:
                    silent[rank] = start
        self._read_states(reports, silent)
        timeout = self._hang_timeout if self._first_done else self._first_step_timeout
        which = "hang_timeout" if self._first_done else "hang_timeout_first_step"
        entries = "; ".join(describe(rank, reports.get(rank)) for rank in stuck)
        others = self._world - len(stuck)
        wait = f"; the other {others} rank(s) wait for it" if others else ""
        line = f"hang: no progress for {timeout:g} s ({which}): {entries}{wait}"
        verdict = {
            "line": line,
            "stuck": [{"rank": rank, **(reports.get(rank) or {})} for rank in stuck],
            "timeout": timeout,
            "setting": which,
        }
        store.compare_set(_VERDICT, "", json.dumps(verdict))
        store.add(_BELL, 1)

    def _read_states(self, reports: dict[int, dict[str, Any]], silent: Mapping[int, str | None]) -> None:
        """The judge: what a rank that answers on the host of each `silent` rank (rank -> when its process
        started) reads of its process (`_probe`), this one or another (asked through `_PROBE`, a few ticks at
        most); into `reports` ("state", and "read_by": the rank that read it, which ends it if it is stopped).
        From another host /proc says nothing; where no rank answers, nothing is read."""
        if not silent:
            return
        store = self._store
        asked = {rank: [reports[rank]["host"], reports[rank]["pid"], start] for rank, start in silent.items()}
        store.set(_PROBE, json.dumps(asked))
        store.add(_BELL, 1)
        self._probed = True
        self._probe(asked)
        deadline = time.monotonic() + max(1.0, 4 * self.tick)
        for rank in silent:
            while not store.check([f"{_STATE}{rank}"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if store.check([f"{_STATE}{rank}"]):
                reports[rank].update(json.loads(store.get(f"{_STATE}{rank}")))

    def _probe(self, asked: Mapping[Any, list[Any]]) -> None:
        """Read the silent ranks of this host (`process_state`); the first rank to answer for one is its
        reader."""
        for rank, (host, pid, start) in asked.items():
            state = process_state(pid, start) if host == self._host else None
            if state is not None:
                self._store.compare_set(f"{_STATE}{rank}", "", json.dumps({"state": state, "read_by": self._rank}))

    def _act(self, verdict: dict[str, Any]) -> None:
        self._acted = True
        stuck_ranks = [entry["rank"] for entry in verdict["stuck"]]
        try:
            directory = self._stacks_dir()  # the run directory: the same on every rank
        except Exception:
            directory = Path.cwd()
        # No stacks are promised for a stopped rank: none of its threads runs. A silent rank that no rank could
        # read (on another host) may be stopped too: its stacks come only if it is stuck in C holding the GIL.
        stacks, promised = [], []
        for entry in verdict["stuck"]:
            if entry.get("state") != "stopped":
                stacks.append(str(directory / f"hang-stacks-rank{entry['rank']}.txt"))
                unread = entry.get("silent") and entry.get("state") is None
                promised.append(stacks[-1] + (" (only if it is stuck in C, not stopped)" if unread else ""))
        listed = f"; stacks: {', '.join(promised)}" if promised else ""
        line = f"{verdict['line']}{listed}; ending the job (exit code {HANG_EXIT_CODE})"
        verdict = self.verdict = {**verdict, "line": line, "stacks": stacks}
        print(f"dream_trainer: [rank {self._rank}] {line}", file=sys.stderr, flush=True)
        if self._rank in stuck_ranks:
            self._write_stacks(directory, line)
        if self._rank == 0:
            if self._on_hang is not None:
                try:
                    self._on_hang(verdict)
                except Exception as exc:  # the job still ends
                    print(f"dream_trainer: could not record the hang: {exc!r}", file=sys.stderr, flush=True)
            self._store.set(_RECORDED, "1")
        if self._rank in stuck_ranks:
            # Rank zero writes run.json before a stuck rank ends: torchrun stops every rank as soon as one
            # ends, and without a handler SIGTERM would end rank zero before its record.
            deadline = time.monotonic() + self._grace
            while self._rank != 0 and not self._store.check([_RECORDED]) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:  # the stuck ranks end first, so torchrun names one of them as the root cause
            began = time.monotonic()
            ended = self._end_frozen(directory, verdict)
            if self._rank == min(set(range(self._world)) - set(stuck_ranks)):
                ended |= self._collect_silent_stacks(directory, verdict)
            if ended >= set(stuck_ranks):
                # Every stuck rank has ended: a stopped one by this rank's SIGKILL, one stuck in C by itself (its
                # faulthandler timer) right after writing its stacks. No grace, but a moment for torchrun to see
                # that first, so it names the stuck rank as the root cause, not this one (both ending in one of
                # its polls, it named the lower rank: seen in CI).
                time.sleep(_AFTER_SILENT_EXIT)
            else:
                time.sleep(max(0.0, self._grace - (time.monotonic() - began)))
        self._finish(verdict)

    def _collect_silent_stacks(self, directory: Path, verdict: dict[str, Any]) -> set[int]:
        """The stacks of stuck ranks that did not answer and are not stopped (stuck in C holding the GIL):
        their faulthandler timer writes them shortly after the verdict, then ends them
        (`dream_trainer.utils.stall_dump`). The ranks whose stacks came (so they have ended)."""
        header, wait = f"dream_trainer: {verdict['line']}", self._report_wait + self._grace
        return {
            entry["rank"]
            for entry in verdict["stuck"]
            if entry.get("silent") and entry.get("state") != "stopped" and "pid" in entry and "host" in entry
            and collect_stacks(directory, entry["rank"], entry["host"], entry["pid"], header, wait)
        }  # fmt: skip

    def _end_frozen(self, directory: Path, verdict: dict[str, Any]) -> set[int]:
        """The stuck ranks this rank found stopped on its host (`_probe`). Nothing of them runs: they cannot
        end themselves, and torchrun's SIGTERM waits until they are continued (its SIGKILL came 30 s later,
        after this healthy rank had ended first and been named the root cause). SIGKILL each, once global
        rank zero recorded the hang (the job goes down as torchrun sees it end), its torchrun error file
        saying why; remove the pending file of its faulthandler timer, which will never fire. The ranks ended."""
        mine = [e for e in verdict["stuck"] if e.get("state") == "stopped" and e.get("read_by") == self._rank]
        if not mine:
            return set()
        deadline = time.monotonic() + self._grace
        recording = not any(e["rank"] == 0 and e.get("silent") for e in verdict["stuck"])  # else none records
        while recording and not self._store.check([_RECORDED]) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = set()
        for entry in mine:
            rank, pid = entry["rank"], entry["pid"]
            try:  # what names its process (`_read_states` keeps it out of the verdict)
                seen = json.loads(self._store.get(f"heartbeat/{rank}"))
            except Exception:
                continue
            state = process_state(pid, seen.get("start"))
            if state == "stopped":  # still: not continued meanwhile, and the pid is not another process's
                if seen.get("error_file"):
                    note = f"(no stack: rank {rank} was stopped; rank {self._rank} ended it with SIGKILL)\n"
                    # Dated when it stopped making progress at the latest (`timeout` ago): torchrun's root cause is
                    # the failure with the earliest date.
                    when = time.time() - verdict["timeout"]
                    _write_error_file(seen["error_file"], f"HangDetected: {verdict['line']}", note, when)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                until = time.monotonic() + 1.0
                while state not in ("gone", None) and time.monotonic() < until:
                    time.sleep(0.02)
                    state = process_state(pid, seen.get("start"))
                with contextlib.suppress(OSError):
                    (directory / pending_name(rank, entry["host"], pid)).unlink()
            if state == "gone":
                ended.add(rank)
        return ended

    def _finish(self, verdict: dict[str, Any] | None) -> None:
        with _FORK_GUARD:
            self._stall.disarm()
        sys.stdout.flush()
        sys.stderr.flush()
        self._end_process(HANG_EXIT_CODE)

    def _write_stacks(self, directory: Path, line: str) -> None:
        """The Python stacks of every thread of this process, in `hang-stacks-rank<R>.txt`; and the main
        thread's, with the verdict, in torchrun's error file (its report shows them)."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"hang-stacks-rank{self._rank}.txt", "w") as f:
                f.write(f"dream_trainer: {line}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as exc:
            print(f"dream_trainer: could not write the stacks of rank {self._rank}: {exc}", file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            frame = sys._current_frames().get(self._main_ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
            _write_error_file(error_file, f"HangDetected: {line}", stack, time.time())


def _write_error_file(path: str, message: str, stack: str, when: float) -> None:
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


class _ForkSafeStore:
    """The c10d store's requests, each one under `_FORK_GUARD` (no fork while one is in flight)."""

    def __init__(self, store: Any) -> None:
        self._inner = store

    def add(self, key: str, amount: int) -> int:
        with _FORK_GUARD:
            return int(self._inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        with _FORK_GUARD:
            return bool(self._inner.check(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with _FORK_GUARD:
            return self._inner.compare_set(key, expected, desired)

    def get(self, key: str) -> bytes:
        with _FORK_GUARD:
            return self._inner.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        with _FORK_GUARD:
            self._inner.set(key, value)

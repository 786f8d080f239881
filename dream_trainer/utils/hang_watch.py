"""The hang verdict of a distributed run, reached out of band through the c10d store.

A collective cannot tell that a rank is stuck: it waits with the stuck rank. One rank's side of the
verdict (`HangWatch`), carried by its watchdog thread (`dream_trainer.utils.watchdog_thread`):

- The main thread only records where it is (`Heartbeat.mark`: two attribute stores, no I/O). The
  thread notices when the marks stop: no mark for `hang_timeout` seconds (`first_step_timeout` until
  the first training step of the fit completes) raises an alarm in the store. Every rank then reports
  where it is: its last mark, its global step, how far it went (`Heartbeat.position`), how long it
  has made no progress, and whether its main thread waits inside a collective (read from its Python
  stack). One rank judges (`dream_trainer.utils.hang_verdict.judge`): the ranks furthest behind are
  stuck (the others wait for them in the next collective), preferring, among equals, those not waiting
  in a collective. Every rank prints the one line of the verdict; each stuck rank writes the Python
  stacks of all its threads to `hang-stacks-rank<R>.txt` in the run directory (`faulthandler`) and
  tells torchrun why it fails (`TORCHELASTIC_ERROR_FILE`); global rank zero records "hung" in run.json;
  then the stuck ranks end at once and the others a moment later (`HANG_EXIT_CODE`), so torchrun names
  a stuck rank as the root cause. It ends its process with `os._exit`: a main thread that ignores
  SIGTERM or waits forever inside a collective ends too. Files are written atomically (a temporary
  name, then a rename), so a save cut short leaves a hidden partial file, never a torn checkpoint.
- A stuck rank that does not report is read by a rank that answers on its host (`process_state`, from
  /proc): one that is stopped (SIGSTOP, a debugger) runs no thread at all, so it can neither write its
  stacks nor end itself, and SIGTERM waits until it is continued. The verdict says so, promises no
  stacks for it, and the rank that read it ends it with SIGKILL (`_end_frozen`) before ending itself.
- A main thread stuck in C holding the GIL starves the watchdog's thread: faulthandler's own thread then
  writes its stacks and ends it (`dream_trainer.utils.stall_dump`, re-armed every few ticks).

Every write the other ranks must see rings the bell (`dream_trainer.utils.watch_store`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dream_trainer.utils.hang_verdict import (
    HANG_EXIT_CODE,
    describe,
    judge,
    main_thread_state,
    write_error_file,
    write_stacks,
)
from dream_trainer.utils.process_state import process_start, process_state
from dream_trainer.utils.stall_dump import StallDump, collect_stacks, pending_name
from dream_trainer.utils.watch_store import FORK_GUARD

if TYPE_CHECKING:
    from dream_trainer.utils.heartbeat import Heartbeat
    from dream_trainer.utils.watch_store import WatchStore

_AFTER_SILENT_EXIT = 1.0  # seconds a healthy rank waits once every stuck rank ended (see _act)

# Keys under the fit's prefix.
_ALARM = "hang/alarm"  # the rank that raised it: it judges
_REPORTS = "hang/reports"
_VERDICT = "hang/verdict"
_RECORDED = "hang/recorded"  # global rank zero wrote run.json
_PROBE = "hang/probe"  # {rank: [host, pid, start]} of silent ranks: a responding rank on that host reads each
_STATE = "hang/state/"  # + rank: what a rank on its host read of a silent rank's process (`process_state`)


class HangWatch:
    """One rank's side of the hang verdict (see the module); the arguments are `Watchdog`'s. Built on the
    main thread (whose stack a report reads); the rest runs on the watchdog's thread: `begin`, then each
    tick `observe`, `on_bell` (the bell rang), `raise_alarm_if_overdue`, `publish_heartbeat_if_due`."""

    def __init__(
        self,
        store: WatchStore,
        rank: int,
        world_size: int,
        heartbeat: Heartbeat,
        *,
        global_step: Callable[[], int],
        hang_timeout: float | None,
        first_step_timeout: float | None,
        stacks_dir: Callable[[], Path],
        on_hang: Callable[[dict[str, Any]], None] | None,
        end_process: Callable[[int], None],
        grace: float,
        tick: float,
    ) -> None:
        self._store = store
        self._rank, self._world = rank, world_size
        self._heartbeat, self._global_step = heartbeat, global_step
        self._hang_timeout, self._first_step_timeout = hang_timeout, first_step_timeout
        self._stacks_dir, self._on_hang, self._end_process = stacks_dir, on_hang, end_process
        self._grace, self._tick = grace, tick
        self._heartbeat_every = max(5.0, tick)
        self._report_wait = max(3.0, 4 * tick)  # for every rank to answer an alarm (6 ticks)
        self._main_ident = threading.get_ident()
        self._host = socket.gethostname()
        self._start, self._error_file = process_start(), os.environ.get("TORCHELASTIC_ERROR_FILE")
        # A main thread stuck in C holding the GIL starves the watchdog's thread: faulthandler's own thread
        # then writes the stacks and ends the process (armed each tick, see dream_trainer.utils.stall_dump).
        self._stall = StallDump(rank, self._host)
        self._next_arm = 0.0  # when the stall timer is re-armed next
        self._armed_for: float | None = None  # the timeout it was armed for (first step's, then hang_timeout)
        self._last_marks, self._last_progress, self._next_heartbeat = 0, 0.0, 0.0  # set by `begin`
        self._start_step, self._first_done = 0, False
        self.verdict: dict[str, Any] | None = None
        self._alarmed = self._reported = self._acted = self._probed = False

    # --- the watchdog's thread ----------------------------------------------------------------------
    def begin(self) -> None:
        """The thread starts: at once, what the others know of this rank if it never ticks again (stuck in
        C from the start). Raises when the store is gone already (the job is ending)."""
        self._last_marks = self._heartbeat.marks
        self._last_progress = self._next_heartbeat = time.monotonic()
        self._start_step = self._global_step()
        self._first_done = False
        self._publish_heartbeat(self._last_progress)
        self._arm_stall()
        self._next_heartbeat = self._last_progress + self._heartbeat_every

    def observe(self, now: float) -> None:
        """Each tick, first: the main thread's progress, and the stall timer."""
        hb = self._heartbeat
        if hb.marks != self._last_marks:
            self._last_marks, self._last_progress = hb.marks, now
        if not self._first_done and self._global_step() != self._start_step:
            self._first_done = True
        self._arm_stall()

    def raise_alarm_if_overdue(self, now: float) -> bool:
        """No mark for the timeout: raise the alarm (once per fit; the first rank to raise it judges). True
        when it did: the bell rang, and this rank reports at once."""
        timeout = self._timeout()
        if timeout is None or self._alarmed or now - self._last_progress <= timeout:
            return False
        self._alarmed = True
        with FORK_GUARD:  # this thread handles the hang: its waits below must not fire the timer
            self._stall.disarm()
        self._store.compare_set(_ALARM, "", str(self._rank))
        self._store.ring()
        return True

    def publish_heartbeat_if_due(self, now: float) -> None:
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self._heartbeat_every
            self._publish_heartbeat(now)

    def on_bell(self) -> None:
        """The bell rang: report an alarm, judge the one this rank raised, read a silent rank of this host,
        carry out the verdict."""
        store = self._store
        if not self._reported and store.check([_ALARM]):
            self._reported = True
            self._alarmed = True  # one alarm per fit
            with FORK_GUARD:
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

    def on_store_lost(self) -> None:
        """The store is gone: its host ended (under srun, global rank zero hosts it, and may end its fit
        first). The job is ending; a hang being handled ends this process as it would have."""
        if self._alarmed:
            self._finish()

    def disarm(self) -> None:
        """The fit ended: no stall timer, no pending file."""
        with FORK_GUARD:
            self._stall.disarm()

    def _timeout(self) -> float | None:
        return self._hang_timeout if self._first_done else self._first_step_timeout

    def _publish_heartbeat(self, now: float) -> None:
        # With when this process started (what names it with its pid, `process_state`) and torchrun's error file: a
        # rank that ends this one, stopped, gives torchrun the verdict through it.
        report = {**self._report(now, with_stack=False), "start": self._start, "error_file": self._error_file}
        self._store.set(f"heartbeat/{self._rank}", json.dumps(report))

    def _arm_stall(self) -> None:
        """Every few ticks: if no tick comes for longer than the other ranks take to judge this one,
        faulthandler writes this process's stacks and ends it (`dream_trainer.utils.stall_dump`). Each arm
        replaces faulthandler's timer thread, so it is done at most every `interval` seconds (the timer
        allows for that), and never while a fork is under way (`FORK_GUARD`): a child must not inherit a
        timer half replaced."""
        timeout = self._timeout()
        if timeout is None or self._alarmed:
            return
        now = time.monotonic()
        interval = min(5.0, max(self._tick, timeout / 2))
        if now < self._next_arm and timeout == self._armed_for:
            return
        self._next_arm, self._armed_for = now + interval, timeout
        directory = self._stacks_dir()
        with FORK_GUARD:
            self._stall.arm(directory, timeout + self._report_wait + 1.0 + interval)

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
        timeout = self._timeout()
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
        store.ring()

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
        store.ring()
        self._probed = True
        self._probe(asked)
        deadline = time.monotonic() + max(1.0, 4 * self._tick)
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
            write_stacks(directory, self._rank, line, sys._current_frames().get(self._main_ident))
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
        self._finish()

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
            try:  # what names its process (`_judge` keeps it out of the verdict)
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
                    write_error_file(seen["error_file"], f"HangDetected: {verdict['line']}", note, when)
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

    def _finish(self) -> None:
        self.disarm()
        sys.stdout.flush()
        sys.stderr.flush()
        self._end_process(HANG_EXIT_CODE)

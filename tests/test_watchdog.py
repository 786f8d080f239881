"""The hang watchdog and the out-of-band stop agreement (docs/unattended.md), in one process.

A real two-process hang and a signal to one rank run under torchrun in tests/test_distributed.py (the
"unattended" launch); a frozen rank (SIGSTOP) runs under torchrun here, last (`watchdog_worker.py`).
Elsewhere here the watchdog runs on a local store: a trainer whose watchdog sees a one-rank world (on one
process it runs only in tests), and two watchdogs in threads sharing a store, as two ranks. The process
the watchdog would end is this test's: ending it releases the stuck place instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from conftest import TinyTrainer, make_regression_data, quiet_config
from helpers import REPO, launcher_free_env, torchrun
from torch.utils.data import DataLoader, Dataset

from dream_trainer import Callback, ModelCheckpoint
from dream_trainer.errors import ConfigError
from dream_trainer.utils.process_state import process_start, process_state
from dream_trainer.utils.watchdog import HANG_EXIT_CODE, Heartbeat, Watchdog


class Released(Exception):
    """The stuck place was let go after the watchdog ended the (pretend) process."""


def stuck_here(released: threading.Event) -> None:
    """Where a test's main thread hangs: the stacks file must name this function."""
    if not released.wait(60):
        raise AssertionError("the watchdog never ended the hang")
    raise Released


class Watched(TinyTrainer):
    """A one-process trainer whose watchdog runs on a local store; `_end_process` releases the hang."""

    def __init__(self, config: Any, stuck_in: str, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.stuck_in = stuck_in
        self.released = threading.Event()
        self.exit_codes: list[int] = []

    def _watchdog_store(self) -> tuple[Any, int, int]:
        return dist.HashStore(), 0, 1

    def _end_process(self, code: int) -> None:
        self.exit_codes.append(code)
        self.released.set()

    def hang_if(self, place: str) -> None:
        if place == self.stuck_in and self.global_step == 2:
            stuck_here(self.released)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.hang_if("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if not self.sanity_checking:
            self.hang_if("validation_step")
        return super().validation_step(batch, batch_idx)


class HangInBatchEnd(Callback):
    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.hang_if("on_train_batch_end")


class SlowItems(Dataset):
    """Items 12 and later do not come until `gate` exists (a DataLoader worker that hangs: reading a file
    on a dead mount)."""

    def __init__(self, gate: Path) -> None:
        self.x, self.y = make_regression_data(16, seed=0)
        self.gate = gate

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        while i >= 12 and not self.gate.exists():
            time.sleep(0.01)
        return self.x[i], self.y[i]


class WorkerHangs(Watched):
    def configure_dataloaders(self) -> Any:
        return DataLoader(SlowItems(Path(self.config.root_dir) / "gate"), batch_size=4, num_workers=1), None

    def _end_process(self, code: int) -> None:
        super()._end_process(code)
        (Path(self.config.root_dir) / "gate").touch()  # the worker goes on: training ends normally


def hang_in_save(released: threading.Event) -> Any:
    def save(*args: Any, **kwargs: Any) -> None:
        stuck_here(released)

    return save


@pytest.mark.parametrize(
    ("place", "where", "step"),
    [
        ("training_step", "training_step", 2),
        ("on_train_batch_end", "on_train_batch_end", 2),
        ("validation_step", "validation_step", 2),
        ("loader worker", "fetching batch", 3),
        ("save", "save_checkpoint (writing)", 2),
        ("load", "load_checkpoint", 0),
    ],
)
def test_a_stuck_place_is_named_its_stacks_written_and_the_run_recorded_hung(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    place: str,
    where: str,
    step: int,
) -> None:
    ckpt = None
    if place == "load":  # a checkpoint to load, written by a run of its own
        done = TinyTrainer(quiet_config(tmp_path / "earlier", max_steps=2))
        done.fit()
        ckpt = done.save_checkpoint(tmp_path / "earlier.ckpt")
    callbacks: list[Any] = [HangInBatchEnd()]
    if place == "save":
        callbacks.append(ModelCheckpoint(every_n_train_steps=2, save_top_k=-1))
    config = quiet_config(
        tmp_path,
        n_epochs=2,
        val_every_n_steps=2,
        hang_timeout=1.0,
        hang_timeout_first_step=1.0 if place == "load" else 20.0,
        callbacks=callbacks,
    )
    cls = WorkerHangs if place == "loader worker" else Watched
    trainer = cls(config, stuck_in=place)
    if place == "save":
        monkeypatch.setattr("dream_trainer.mixins.checkpoint.atomic_save", hang_in_save(trainer.released))
    if place == "load":
        monkeypatch.setattr(
            "dream_trainer.mixins.checkpoint.read_checkpoint", lambda path: stuck_here(trainer.released)
        )
    began = time.monotonic()
    if place == "loader worker":
        trainer.fit(ckpt_path=ckpt)  # the worker was let go: training went on to its end
    else:
        with pytest.raises(Released):
            trainer.fit(ckpt_path=ckpt)
    took = time.monotonic() - began

    assert trainer.exit_codes == [HANG_EXIT_CODE]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "hang: no progress" in line]
    assert len(lines) == 1, err
    assert f"rank 0: {where} at global step {step}" in lines[0], lines[0]
    stacks = trainer.run_dir / "hang-stacks-rank0.txt"
    assert stacks.exists() and str(stacks) in lines[0]
    if place == "loader worker":  # the main thread waits for the worker, in the trainer's loop
        assert "_iter_train_batches" in stacks.read_text()
    else:
        assert "in stuck_here" in stacks.read_text()
    record = json.loads((trainer.run_dir / "run.json").read_text())
    assert record["status"] == "hung", record
    assert [(s["rank"], s["where"], s["step"]) for s in record["hang"]["stuck"]] == [(0, where, step)]
    assert record["end_reason"] == record["hang"]["line"]
    assert took < 15, f"the hang took {took:.1f} s to be ended with hang_timeout=1"


# --- two ranks, as two threads on one store -----------------------------------------------------------
class FakeRank:
    """One rank: a thread that marks `marks` places, then hangs (`stuck_here`) until its watchdog ends it.
    `world` ranks in all; `hang`: its hang_timeout; `host`: the host its watchdog says it runs on."""

    def __init__(
        self,
        store: Any,
        rank: int,
        tmp_path: Path,
        marks: list[str],
        step: int,
        log: list[Any],
        world: int = 2,
        hang: float = 0.5,
        host: str | None = None,
    ) -> None:
        self.world, self.hang, self.host = world, hang, host
        self.heartbeat = Heartbeat()
        self.released = threading.Event()
        self.signal: int | None = None
        self.step = step
        self.rank, self.tmp_path, self.marks, self.log, self.store = rank, tmp_path, marks, log, store
        self.watchdog: Watchdog | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.main, daemon=True)

    def end(self, code: int) -> None:
        self.log.append((self.rank, code, time.monotonic()))
        self.released.set()

    def make_watchdog(self, hang: float | None) -> Watchdog:
        return Watchdog(
            dist.PrefixStore("fit0/", self.store),
            self.rank,
            self.world,
            self.heartbeat,
            global_step=lambda: self.step,
            local_signal=lambda: self.signal,
            hang_timeout=hang,
            first_step_timeout=hang,
            stacks_dir=lambda: self.tmp_path,
            end_process=self.end,
            grace=0.5,
            tick=0.05,
        )

    def main(self) -> None:
        self.watchdog = self.make_watchdog(self.hang)  # made on the thread it watches (its "main thread")
        if self.host is not None:
            self.watchdog.hang._host = self.host
        self.watchdog.start()
        for where in self.marks:
            self.heartbeat.mark(where)
        self.ready.set()
        with contextlib.suppress(Released):
            stuck_here(self.released)


def test_the_rank_behind_is_named_and_ends_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Rank 1 stopped in on_train_batch_end at step 5; rank 0 went on into step 6 and waits there (in a
    # collective, for rank 1). Both stopped marking: the rank that got less far is the stuck one.
    store, log = dist.HashStore(), []
    behind = ["training_step", "backward", "on_train_batch_end"]
    ranks = [
        FakeRank(store, 0, tmp_path, [*behind, "fetching batch", "training_step", "backward"], 5, log),
        FakeRank(store, 1, tmp_path, behind, 5, log),
    ]
    for r in ranks:
        r.thread.start()
    for r in ranks:
        r.thread.join(20)
    assert [(rank, code) for rank, code, _ in log] == [(1, HANG_EXIT_CODE), (0, HANG_EXIT_CODE)], log
    lines = [line for line in capsys.readouterr().err.splitlines() if "hang: no progress" in line]
    assert len(lines) == 2 and lines[0].split("]", 1)[1] == lines[1].split("]", 1)[1], lines  # one verdict
    assert "rank 1: on_train_batch_end at global step 5" in lines[0] and "rank 0:" not in lines[0], lines[0]
    assert "the other 1 rank(s) wait for it" in lines[0]
    assert (tmp_path / "hang-stacks-rank1.txt").exists() and not (tmp_path / "hang-stacks-rank0.txt").exists()
    assert "in stuck_here" in (tmp_path / "hang-stacks-rank1.txt").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP and /proc")
def test_a_stopped_rank_is_read_and_ended_by_a_rank_on_its_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rank 2 is a stopped process of this host that never reports (its heartbeat names it). Rank 0 judges from
    # another host, where /proc cannot see it: it asks, and rank 1, on rank 2's host, reads it stopped, and ends
    # it with SIGKILL. The verdict promises no stacks for it.
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(frozen.pid) in ("running", "uninterruptible")  # D: reading its files as it starts
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(frozen.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(frozen.pid, process_start(frozen.pid)) == "stopped"
        assert process_state(frozen.pid, "0") == "gone"  # that pid, but not that process (it started then)
        store, log = dist.HashStore(), []
        heartbeat = {"where": "training_step", "step": 5, "position": [5, 1], "idle": 0.0}
        heartbeat.update(host=socket.gethostname(), pid=frozen.pid, start=process_start(frozen.pid))
        dist.PrefixStore("fit0/", store).set("heartbeat/2", json.dumps(heartbeat))  # the ranks' prefix
        ranks = [  # rank 0 raises the alarm first: it judges
            FakeRank(store, 0, tmp_path, ["training_step"], 5, log, world=3, host="elsewhere"),
            FakeRank(store, 1, tmp_path, ["training_step"], 5, log, world=3, hang=5.0),
        ]
        for r in ranks:
            r.thread.start()
        for r in ranks:
            r.thread.join(20)
        assert frozen.wait(5) == -signal.SIGKILL
    finally:
        frozen.kill()
        frozen.wait()
    assert process_state(frozen.pid) == "gone"
    assert sorted((rank, code) for rank, code, _ in log) == [(0, HANG_EXIT_CODE), (1, HANG_EXIT_CODE)], log
    lines = [line for line in capsys.readouterr().err.splitlines() if "hang: no progress" in line]
    assert len(lines) == 2 and lines[0].split("]", 1)[1] == lines[1].split("]", 1)[1], lines  # one verdict
    assert "rank 2: frozen (stopped, by SIGSTOP or a debugger; last seen: training_step at global step 5; " in lines[0]
    assert "no stacks can come from it; rank 1 ends it with SIGKILL)" in lines[0] and "stacks:" not in lines[0]
    verdict = ranks[0].watchdog.verdict if ranks[0].watchdog else None
    assert verdict is not None and verdict["stacks"] == [], verdict
    assert [(e["rank"], e["state"], e["read_by"]) for e in verdict["stuck"]] == [(2, "stopped", 1)], verdict


def test_what_a_verdict_says_of_a_rank_that_does_not_answer() -> None:
    from dream_trainer.utils.watchdog import describe

    seen = {"where": "backward", "step": 7, "idle": 1.0, "host": "node7", "pid": 42, "silent": True}
    assert describe(3, {**seen, "state": "running"}) == (
        "rank 3: backward at global step 7, 1 s without progress (not responding; its last heartbeat)"
    )
    assert "its main thread in uninterruptible I/O, state D)" in describe(3, {**seen, "state": "uninterruptible"})
    # On a host where no rank answers, nobody can tell whether it is stopped.
    assert describe(3, seen).endswith(
        "(not responding; its last heartbeat; no rank that answers can read its state on node7)"
    )
    assert describe(3, {**seen, "state": "stopped", "read_by": 2}) == (
        "rank 3: frozen (stopped, by SIGSTOP or a debugger; last seen: backward at global step 7; no stacks can come "
        "from it; rank 2 ends it with SIGKILL)"
    )


def test_ranks_agree_on_a_stop_step_no_rank_has_passed() -> None:
    # Rank 0 got SIGTERM at the end of step 3; rank 1 is inside step 4 (so it can stop at the end of 4
    # at the earliest). Both must stop at step 4, without any collective.
    store = dist.HashStore()
    steps = {0: 3, 1: 3}
    signals: dict[int, int | None] = {0: signal.SIGTERM, 1: None}
    watchdogs = [
        Watchdog(
            dist.PrefixStore("fit0/", store),
            rank,
            2,
            Heartbeat(),
            global_step=lambda rank=rank: steps[rank],
            local_signal=lambda rank=rank: signals[rank],
            hang_timeout=None,
            first_step_timeout=None,
            stacks_dir=Path,
            end_process=lambda code: None,
            tick=0.05,
        )
        for rank in (0, 1)
    ]
    for w in watchdogs:
        w.start()
    try:
        deadline = time.monotonic() + 10
        while not watchdogs[1].stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watchdogs[1].stop_requested and watchdogs[1].signal_number == signal.SIGTERM
        assert watchdogs[0].agreed_stop(signal.SIGTERM, 3) == 4  # rank 0 goes on for one more step
        steps[1] = 4
        assert watchdogs[1].agreed_stop(None, 4) == 4
    finally:
        for w in watchdogs:
            w.close()


def test_hang_timeouts_are_validated_at_construction() -> None:
    for bad in (0, -1.0, "600", True):
        with pytest.raises(ConfigError, match="hang_timeout = "):
            quiet_config(hang_timeout=bad)
        with pytest.raises(ConfigError, match="hang_timeout_first_step = "):
            quiet_config(hang_timeout_first_step=bad)
    assert quiet_config(hang_timeout=None).hang_timeout is None


def test_a_fit_without_a_hang_leaves_no_pending_stacks_file(tmp_path: Path) -> None:
    # The watchdog arms faulthandler's timer (for a rank stuck in C holding the GIL) into a hidden pending
    # file each tick; a fit that ends normally leaves no such file.
    trainer = Watched(quiet_config(tmp_path, n_epochs=2, hang_timeout=5.0), stuck_in="nowhere")
    trainer.fit()
    assert trainer.exit_codes == []
    leftovers = [p.name for p in tmp_path.rglob(".hang-stacks-*")]
    assert leftovers == []
    assert not list(trainer.run_dir.glob("hang-stacks-*"))


def test_stacks_a_stuck_process_left_are_filed_under_the_verdict(tmp_path: Path) -> None:
    from dream_trainer.utils.stall_dump import collect_stacks, pending_name

    pending = tmp_path / pending_name(1, "node7", 4242)
    pending.write_text('Thread 0x1 (most recent call first):\n  File "train.py", line 9 in stuck\n')
    assert collect_stacks(tmp_path, 1, "node7", 4242, "dream_trainer: hang: the verdict", wait=2.0)
    text = (tmp_path / "hang-stacks-rank1.txt").read_text()
    assert text.startswith("dream_trainer: hang: the verdict\n\n") and "line 9 in stuck" in text
    assert not pending.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hang-stacks-rank1.txt"]
    # Nothing came (another node's disk): nothing is written, after the wait.
    assert not collect_stacks(tmp_path, 2, "node7", 4243, "dream_trainer: hang", wait=0.5)


def test_the_watchdog_finds_the_launchers_store_without_torchs_private_accessor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch has no public accessor for the default group's store; should its private one go, the watchdog
    # joins the TCPStore the launcher's environment names.
    class Distributed(TinyTrainer):
        is_distributed = True  # type: ignore[assignment]

    launcher = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launcher.port))
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    found = Distributed(quiet_config(tmp_path))._watchdog_store()
    assert found is not None
    store, rank, world = found
    store.set("from-the-watchdog", "1")
    assert launcher.get("from-the-watchdog") == b"1" and (rank, world) == (0, 1)


# --- what the training step marks ----------------------------------------------------------------------
class RecordingHeartbeat(Heartbeat):
    """A heartbeat that also keeps every place marked, in order (`batch:` for a batch's start)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def mark(self, where: str) -> None:
        self.log.append(where)
        super().mark(where)

    def start_batch(self, where: str) -> None:
        self.log.append(f"batch:{where}")
        super().start_batch(where)


PER_BATCH = ["batch:on_train_batch_start", "training_step", "backward", "optimizer step", "on_train_batch_end"]


def test_the_training_step_marks_where_it_is_only_while_a_watchdog_runs(tmp_path: Path) -> None:
    # Marks are what the watchdog compares across ranks: with one running, every batch passes the same ones
    # in the same order. Without one (one process: nothing reads them), the per-batch path marks nothing:
    # the marks were five calls per batch that nobody read.
    watched = Watched(quiet_config(tmp_path / "watched", n_epochs=1, hang_timeout=30.0), stuck_in="nowhere")
    unwatched = TinyTrainer(quiet_config(tmp_path / "unwatched", n_epochs=1, hang_timeout=30.0))
    for trainer in (watched, unwatched):
        trainer._heartbeat = RecordingHeartbeat()  # before fit(): the bus and the watchdog take it there
        trainer.fit()
    log = watched._heartbeat.log
    assert watched._heartbeat.batches == 4
    starts = [i for i, where in enumerate(log) if where.startswith("batch:")]
    assert [log[i : i + len(PER_BATCH)] for i in starts] == [PER_BATCH] * 4, log
    assert all(log[i - 1] == "fetching batch" for i in starts), log
    assert unwatched._heartbeat.batches == 0
    assert not set(unwatched._heartbeat.log) & {"fetching batch", *PER_BATCH}, unwatched._heartbeat.log


def test_a_rank_stuck_fetching_a_batch_on_a_python_with_the_fork_deadlock_is_told_the_cause_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A loader worker forked while another thread holds the interpreter's thread-list lock hangs before running
    # Python code on Python <= 3.11.7 (seen under load in the suite): the verdict names the CPython bug and what
    # avoids it; on a fixed Python, or a rank stuck elsewhere, it does not.
    from dream_trainer.utils import hang_verdict

    report = {"where": "fetching batch", "step": 12, "idle": 61.0, "at": "_try_get_data (stateful_dataloader.py:1215)"}
    monkeypatch.setattr(hang_verdict, "_FORK_DEADLOCKS", True)
    text = hang_verdict.describe(1, report)
    assert text.startswith("rank 1: fetching batch at global step 12, 61 s without progress [in _try_get_data")
    assert "CPython gh-112275" in text and "multiprocessing_context='forkserver'" in text
    assert "gh-112275" not in hang_verdict.describe(1, {**report, "where": "training_step"})
    monkeypatch.setattr(hang_verdict, "_FORK_DEADLOCKS", False)
    assert "gh-112275" not in hang_verdict.describe(1, report)


# --- a frozen rank, under torchrun ---------------------------------------------------------------------------
WORKER = Path(__file__).with_name("watchdog_worker.py")


def end_launch(agent: subprocess.Popen[str]) -> None:
    """SIGKILL torchrun's process group and each of its workers' (torchrun starts each worker in a session of
    its own, so the agent's group does not hold them): nothing the launch started outlives the test."""
    workers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == agent.pid:  # its parent
                workers.append(int(stat.parent.name))
    for group in [*workers, agent.pid]:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    if agent.poll() is None:
        agent.wait()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP and /proc")
def test_a_frozen_rank_is_named_ended_and_torchruns_root_cause(tmp_path: Path) -> None:
    # Rank 1 stops (SIGSTOP) at the end of step 5: none of its threads runs, faulthandler's neither, so no stacks
    # can come from it, and SIGTERM waits until it is continued. Before, rank 0 ended 21 s after the freeze with
    # hang_timeout=10, torchrun named it (the healthy rank) as the root cause and SIGKILLed rank 1 30 s later.
    hang = 2
    root, info = tmp_path / "frozen", tmp_path / "info"
    args = ["--freeze-rank", "1", "--freeze-at-step", "5", "--root-dir", str(root), "--info-dir", str(info),
            "--batch-size", "4", "--strategy", "ddp", "--epochs", "2", "--timeout", "60",
            "--hang-timeout", str(hang), "--hang-timeout-first-step", "60"]  # fmt: skip
    env = {**launcher_free_env(), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [*torchrun("--standalone", "--nproc_per_node", "2", forked=False), str(WORKER), *args]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)  # fmt: skip
    try:
        try:
            output = agent.communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            end_launch(agent)
            pytest.fail("the launch did not end within 180 s:\n" + agent.communicate()[0][-10000:])
        ended = time.time()
    finally:
        end_launch(agent)
    described = f"exit code {agent.returncode}\n--- output\n{output[-10000:]}"

    assert agent.returncode != 0, described
    frozen_at = info / "rank1.failed_at"
    assert frozen_at.exists(), "rank 1 never froze: " + described
    took = ended - float(frozen_at.read_text())
    assert took <= hang + 10, f"the job took {took:.1f} s to end after rank 1 froze, with hang_timeout={hang}"
    lines = [line for line in output.splitlines() if line.startswith("dream_trainer: [rank")]
    assert len(lines) == 1 and lines[0].startswith("dream_trainer: [rank 0] hang: no progress"), described
    line = lines[0]
    assert "rank 1: " in line and "rank 0: " not in line, line
    assert "frozen" in line and "no stacks can come from it" in line and "rank 0 ends it with SIGKILL" in line, line
    assert "hang-stacks-rank1.txt" not in line and "stacks:" not in line, line  # none promised
    assert len(line) < 300, line
    # torchrun's report names the frozen rank as the root cause (it ended first), with the verdict.
    root_cause = output[output.find("Root Cause") :]
    assert re.search(r"rank\s*:\s*1 ", root_cause) and "HangDetected" in root_cause, described
    assert "frozen" in root_cause, described
    run_dir = root / "run"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "hung", record
    assert [(s["rank"], s.get("state")) for s in record["hang"]["stuck"]] == [(1, "stopped")], record
    assert record["hang"]["stacks"] == [], record
    left = sorted(p.name for p in run_dir.glob("*hang-stacks*"))
    assert left == [], left  # no stacks file, and the stopped rank's pending one was removed

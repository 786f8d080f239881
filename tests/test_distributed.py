"""Distributed training on CPU (gloo) through real `torchrun` launches (DESIGN.md, Distributed and
Checkpoints).

The runs are `dist_worker.py` (see its docstring for the run and what it writes). One process runs in
this process (`dist_worker.main`); several processes run under `python -m torch.distributed.run`
(= `torchrun`), each launch running a *plan*: several runs in turn in the same processes, so that the
~25 cases here cost 8 launches. The worker's run: a Tanh MLP, SGD with momentum, 32 training samples,
2 epochs, a global batch of 8 (so 4 steps per epoch, 8 in all), 16 validation samples, validation at
each epoch end (steps 4 and 8).

Each launch happens at most once per test run, by whichever xdist worker needs it first (a file lock
per launch); the others read its results. The launches (`LAUNCHES`):

- main         2 processes: the reference runs (DDP, FSDP sharded and gathered checkpoints, shuffled
               DDP), accumulation (DDP and FSDP; DDP with a short last window), who writes, a metric one
               rank logs, checkpoints loaded across strategies, a bad batch on one rank
               (tests/test_spikes_ddp.py); last, a run whose rank 1 is SIGKILLed at step 5 (the launch
               fails there).
- resume       2 processes: shuffled DDP again (a second launch must reproduce it), the SIGKILLed run
               resumed (from a copy of its directory), then a run stopped by SIGTERM sent to torchrun.
- after-signal 2 processes, process_group_timeout=30: the SIGTERMed run resumed, then a run whose rank
               1 exits at step 5 (the launch must end instead of hanging).
- stuck        2 processes, process_group_timeout=8: rank 1 stops taking part at step 3.
- unattended   2 processes, steps of 0.5 s: SIGTERM reaches rank 1 only, at step 2 (the ranks stop
               together within a few seconds), the run resumed; then rank 1 hangs inside training_step
               at step 5 and the hang watchdog (hang_timeout=2) ends the job.
- two-nodes    two torchrun agents of one process each, c10d rendezvous on loopback.
- restart-shared / restart-per-round: --max-restarts 1, rank 1 killed on the first attempt.

A plan's processes keep one process group, created by the first run, so a launch whose cases need a
`process_group_timeout` gives it to every run in it. One-process references (`single`,
`single_ddp_order`) run here, once per test run, before `main` (which loads `single`'s checkpoint).

Tolerances: DDP/FSDP against one process agree to float rounding (the same gradients summed in another
order), so 1e-5; a run against a rerun or a resumed run of the *same* launch configuration must be
bit-exact (`torch.equal`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dist_worker
import pytest
import torch
from dist_spike_cases import spike_cases
from helpers import REPO, file_lock, launcher_free_env, nothing_frozen, torchrun, xdist_shared_dir

pytestmark = pytest.mark.slow  # 8 torchrun launches in all (each: ~5-15 s of CPU), shared by the tests here

WORKER = Path(__file__).with_name("dist_worker.py")
TIMEOUT = 300  # seconds for one launch (a plan of several runs); a launch normally takes 5-30 s
TOL = 1e-5

PLAIN = ("--epochs", "2", "--save-every", "3")
SHUFFLED = ("--shuffle", "--epochs", "2", "--save-every", "3")
SINGLE = ("--batch-size", "8")
DDP = ("--batch-size", "4", "--strategy", "ddp")
FSDP = ("--batch-size", "4", "--strategy", "fsdp")
KILL_1_AT_5 = ("--kill-rank", "1", "--kill-at-step", "5")
ACCUM = ("--epochs", "2", "--batch-size", "2", "--accum", "2", "--strategy", "ddp")  # 2 micro-batches a step
ACCUM_FSDP = ("--epochs", "2", "--batch-size", "2", "--accum", "2", "--strategy", "fsdp")  # sharded checkpoints
# 8 micro-batches an epoch in windows of 3: the epoch's last window has 2 (its last one must all-reduce).
ACCUM_SHORT = ("--epochs", "1", "--accum", "3")

# One-process reference runs (in this process): name -> worker arguments.
SINGLE_REFERENCES: dict[str, tuple[str, ...]] = {
    "single": (*PLAIN, *SINGLE),
    "single_ddp_order": (*SHUFFLED, *SINGLE, "--ddp-order"),
    "single_accum_short": (*ACCUM_SHORT, "--batch-size", "4"),
}
STEP3 = Path("run", "checkpoints", "epoch=0-step=3.ckpt")  # the step-3 checkpoint of a case's root_dir


# --- launching ------------------------------------------------------------------------------------
def worker_env() -> dict[str, str]:
    """This environment minus anything a surrounding torchrun set, plus the repo on PYTHONPATH."""
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def case_argv(directory: Path, name: str, args: Sequence[str]) -> list[str]:
    """A run's worker arguments: root_dir `DIR/<name>`, result `DIR/<name>.pt`, info `DIR/<name>-info`."""
    d = directory
    return ["--root-dir", str(d / name), "--out", str(d / f"{name}.pt"), "--info-dir", str(d / f"{name}-info"), *args]


def write_plan(directory: Path, cases: Sequence[tuple[str, Sequence[str]]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    plan = directory / "plan.json"
    plan.write_text(json.dumps([[name, case_argv(directory, name, args)] for name, args in cases]))
    return plan


@dataclass
class Launch:
    """What one launch left: its exit code, output and end time, and each case's files in `directory`."""

    directory: Path
    returncode: int
    seconds: float
    ended: float  # time.time() when the launch had ended
    output: str  # stdout + stderr

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        return f"exit code {self.returncode} after {self.seconds:.1f} s\n--- output\n{self.output[-10000:]}"

    def root(self, case: str) -> Path:
        return self.directory / case

    def out(self, case: str) -> Path:
        return self.directory / f"{case}.pt"

    def result(self, case: str) -> dict[str, Any]:
        errors = sorted(self.directory.glob(f"{case}.error.rank*"))
        assert not errors, f"case {case!r} raised on {errors[0].name}:\n{errors[0].read_text()}\n" + self.describe()
        assert self.out(case).exists(), f"case {case!r} wrote no result: " + self.describe()
        return torch.load(self.out(case), weights_only=True)

    def info(self, case: str) -> dict[int, dict[str, Any]]:
        """Each rank's `rank<R>.json` (written in teardown; missing for a rank that was SIGKILLed)."""
        return {
            int(p.stem[4:]): json.loads(p.read_text()) for p in (self.directory / f"{case}-info").glob("rank*.json")
        }

    def failed_at(self, case: str, rank: int) -> float:
        """When the worker made `rank` fail (`--kill-*`), as time.time()."""
        path = self.directory / f"{case}-info" / f"rank{rank}.failed_at"
        assert path.exists(), f"rank {rank} of {case!r} never reached its failure point: " + self.describe()
        return float(path.read_text())


def finished(directory: Path, start: float, returncode: int, output: str) -> Launch:
    return Launch(directory, returncode, time.monotonic() - start, time.time(), output)


def run_plan(
    directory: Path,
    cases: Sequence[tuple[str, Sequence[str]]],
    launcher_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    until: Callable[[subprocess.Popen[str]], None] | None = None,
) -> Launch:
    """`torchrun --standalone --nproc_per_node 2 dist_worker.py --plan` over `cases`. `until(agent)`, if
    given, runs while the launch does (to signal it)."""
    plan = write_plan(directory, cases)
    cmd = [*torchrun("--standalone", "--nproc_per_node", "2", *launcher_args), str(WORKER), "--plan", str(plan)]
    start = time.monotonic()
    agent = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**worker_env(), **(env or {})}
    )
    try:
        if until is not None:
            until(agent)
        output = agent.communicate(timeout=TIMEOUT)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    return finished(directory, start, agent.returncode, output)


def shared_launch(factory: pytest.TempPathFactory, name: str, start: Callable[[Path], Launch]) -> Launch:
    """`start(directory)` once per test run, by the first xdist worker to ask; the others read what it
    left. A launch that raised (a timeout, say) is reported as failed, with the traceback as output."""
    shared = xdist_shared_dir(factory, f"distributed-{name}")
    record = shared / "launch.json"
    with file_lock(shared / "lock"):
        if not record.exists():
            began = time.monotonic()
            try:
                launch = start(shared / "cases")
            except Exception:
                launch = finished(shared / "cases", began, -1, traceback.format_exc())
            record.write_text(json.dumps({k: getattr(launch, k) for k in ("returncode", "seconds", "ended", "output")}))
    return Launch(shared / "cases", **json.loads(record.read_text()))


# --- the launches -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process reference runs, in this process, once per test run: their directory (each
    run's files named as in a plan: `<name>/`, `<name>.pt`)."""
    shared = xdist_shared_dir(tmp_path_factory, "distributed-single")
    with file_lock(shared / "lock"), nothing_frozen():  # what the trainer does with the collector is compared
        for name, args in SINGLE_REFERENCES.items():
            if not (shared / f"{name}.pt").exists():
                assert dist_worker.main(case_argv(shared, name, args)) == 0
    return shared


def single_result(single: Path, name: str) -> dict[str, Any]:
    return torch.load(single / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory, single: Path) -> Launch:
    def start(d: Path) -> Launch:
        cases: list[tuple[str, Sequence[str]]] = [
            ("ddp", (*PLAIN, *DDP)),
            ("fsdp", (*PLAIN, *FSDP)),  # sharded (DCP directory) checkpoints, the FSDP default
            ("fsdp_file", (*PLAIN, *FSDP, "--fsdp-full-checkpoints")),  # gathered single-file checkpoints
            ("ddp_shuffled", (*SHUFFLED, *DDP)),
            ("accum", (*ACCUM, "--count-allreduce")),
            ("accum-short", (*ACCUM_SHORT, "--batch-size", "2", "--strategy", "ddp", "--count-allreduce")),
            # a checkpoint written inside step 5's window, then a run resumed from it (mid-epoch, mid-window)
            ("accum-mid", (*ACCUM, "--save-mid-window-at", "5")),
            ("accum-mid-resumed", (*ACCUM, "--ckpt", str(d / "accum-mid" / "mid-window.ckpt"))),
            # the same under FSDP2, its mid-window checkpoint a sharded (DCP) directory
            ("fsdp-accum", ACCUM_FSDP),
            ("fsdp-accum-mid", (*ACCUM_FSDP, "--save-mid-window-at", "5")),
            ("fsdp-accum-mid-resumed", (*ACCUM_FSDP, "--ckpt", str(d / "fsdp-accum-mid" / "mid-window.ckpt"))),
            ("writes", (*PLAIN, *DDP, "--per-rank-root", "--file-loggers", "--verbose",
                        "--stdout-dir", str(d / "stdout"))),
            ("rank_metric", (*PLAIN, *DDP, "--log-every", "2", "--rank-metric")),
            # checkpoints across strategies (the targets with one process run in the test)
            ("single-to-ddp", ("--epochs", "2", *DDP, "--ckpt", str(single / "single" / STEP3))),
            ("ddp-to-fsdp", ("--epochs", "2", *FSDP, "--ckpt", str(d / "ddp" / STEP3))),
            ("fsdp-to-ddp", ("--epochs", "2", *DDP, "--ckpt", str(d / "fsdp" / STEP3))),
            *spike_cases(d),  # a bad batch on rank 1: tests/test_spikes_ddp.py
            # last: this one ends the launch
            ("killed", (*SHUFFLED, *DDP, *KILL_1_AT_5, "--kill-how", "sigkill")),
        ]  # fmt: skip
        return run_plan(d, cases)

    return shared_launch(tmp_path_factory, "main", start)


@pytest.fixture(scope="module")
def resume(tmp_path_factory: pytest.TempPathFactory, main: Launch) -> Launch:
    def start(d: Path) -> Launch:
        d.mkdir(parents=True)
        # A copy: `main`'s directory stays as the kill left it.
        shutil.copytree(main.root("killed"), d / "killed-resumed", symlinks=True)
        ready = d / "ready"

        def sigterm_at_step_5(agent: subprocess.Popen[str]) -> None:
            deadline = time.monotonic() + TIMEOUT
            while not ready.exists():
                if agent.poll() is not None or time.monotonic() > deadline:
                    return  # the launch ended (or hangs) before the step: the test reports it
                time.sleep(0.05)
            agent.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to its workers

        wait = ("--wait-for-signal-rank", "1", "--wait-for-signal-at-step", "5", "--ready-file", str(ready))
        cases: list[tuple[str, Sequence[str]]] = [
            ("again", (*SHUFFLED, *DDP)),
            ("killed-resumed", (*SHUFFLED, *DDP, "--resume")),
            ("signalled", (*SHUFFLED, *DDP, "--log-every", "1", *wait)),  # last: the signal ends the launch
        ]
        return run_plan(d, cases, until=sigterm_at_step_5)

    return shared_launch(tmp_path_factory, "resume", start)


@pytest.fixture(scope="module")
def after_signal(tmp_path_factory: pytest.TempPathFactory, resume: Launch) -> Launch:
    def start(d: Path) -> Launch:
        d.mkdir(parents=True)
        shutil.copytree(resume.root("signalled"), d / "signalled-resumed", symlinks=True)
        timeout = ("--timeout", "30")  # the process group's, for both runs (the first one creates it)
        cases: list[tuple[str, Sequence[str]]] = [
            ("signalled-resumed", (*SHUFFLED, *DDP, "--log-every", "1", "--resume", *timeout)),
            ("dead", (*SHUFFLED, *DDP, *timeout, *KILL_1_AT_5, "--kill-how", "exit")),  # last: ends the launch
        ]
        return run_plan(d, cases)

    return shared_launch(tmp_path_factory, "after-signal", start)


@pytest.fixture(scope="module")
def stuck(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    # Rank 1 stuck in C code holding the GIL (no Python thread of it runs again) at step 5; 0.3 s steps so
    # its watchdog ticked after the first step (hang_timeout, not the first step's, is armed).
    args = (*PLAIN, *DDP, "--timeout", "60", *KILL_1_AT_5, "--kill-how", "hang-in-c", "--sleep-per-step", "0.3",
            "--hang-timeout", "2", "--hang-timeout-first-step", "60")  # fmt: skip
    return shared_launch(tmp_path_factory, "stuck", lambda d: run_plan(d, [("stuck", args)]))


@pytest.fixture(scope="module")
def unattended(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    def start(d: Path) -> Launch:
        slow = ("--sleep-per-step", "0.5", "--log-every", "50")  # no logging point: only the store agrees
        cases: list[tuple[str, Sequence[str]]] = [
            ("sigterm-one", (*SHUFFLED, *DDP, *slow, "--timeout", "60", "--kill-rank", "1", "--kill-at-step", "2",
                             "--kill-how", "sigterm", "--interrupted-ok")),
            ("sigterm-resumed", (*SHUFFLED, *DDP, "--root-dir", str(d / "sigterm-one"), "--resume")),
            ("hung", (*PLAIN, *DDP, *KILL_1_AT_5, "--kill-how", "hang-in-step", "--hang-timeout", "2",
                      "--hang-timeout-first-step", "60")),  # last: ends the launch
        ]  # fmt: skip
        return run_plan(d, cases)

    return shared_launch(tmp_path_factory, "unattended", start)


@pytest.fixture(scope="module", params=["shared", "per-round"])
def restarted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    # torchrun restarts the whole worker group once; the worker kills rank 1 only on the first attempt
    # (TORCHELASTIC_RESTART_COUNT == 0) and every attempt uses resume_from="last".
    # "shared": torchrun's default, where the restarted workers' process group meets in the same TCPStore
    # as the first attempt's (the rendezvous store is shared and reused across rounds, and nothing
    # prefixes it per attempt), so the first attempt's keys are still there; "per-round": a fresh store
    # per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    store = request.param
    args = (*SHUFFLED, *DDP, "--timeout", "30", "--resume-from", "last")
    kill = (*KILL_1_AT_5, "--kill-how", "exit", "--kill-first-attempt-only")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if store == "per-round" else {}

    def start(d: Path) -> Launch:
        return run_plan(d, [("restarted", (*args, *kill))], launcher_args=("--max-restarts", "1"), env=env)

    return shared_launch(tmp_path_factory, f"restart-{store}", start)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    # Two torchrun agents ("nodes") of one process each meet at a c10d rendezvous on 127.0.0.1. c10d
    # ignores --node_rank (it assigns node ranks in arrival order); --local-addr keeps the workers'
    # process group on the loopback interface.
    def start(d: Path) -> Launch:
        plan = write_plan(d, [("two-nodes", (*PLAIN, *DDP))])
        port = free_port()
        begin = time.monotonic()
        agents = []
        for node in (0, 1):
            launcher = torchrun(
                "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"two-nodes-{port}", "--local-addr", "127.0.0.1",
            )  # fmt: skip
            agents.append(
                subprocess.Popen(
                    [*launcher, str(WORKER), "--plan", str(plan)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=worker_env(),
                )
            )
        try:
            outputs = [a.communicate(timeout=TIMEOUT)[0] for a in agents]
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                    a.communicate()
        returncode = next((a.returncode for a in agents if a.returncode), 0)
        text = "".join(
            f"--- node {n}: exit code {a.returncode}\n{o}\n"
            for n, (a, o) in enumerate(zip(agents, outputs, strict=True))
        )
        return finished(d, begin, returncode, text)

    return shared_launch(tmp_path_factory, "two-nodes", start)


# --- comparisons ------------------------------------------------------------------------------------
def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different parameter names: {sorted(a)} vs {sorted(b)}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL) -> None:
    diff = max_abs_diff(a, b)
    assert diff <= tol, f"weights differ by up to {diff:.3e} (> {tol:g})"


def assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    bad = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not bad, f"weights are not bit-exact; max abs difference per tensor: {bad}"


def assert_close_series(got: list[tuple[int, float]], want: list[tuple[int, float]], what: str) -> None:
    assert [s for s, _ in got] == [s for s, _ in want], f"{what} logged at steps {got} vs {want}"
    for (step, g), (_, w) in zip(got, want, strict=True):
        assert math.isclose(g, w, rel_tol=TOL, abs_tol=1e-7), f"{what} at step {step}: {g!r} vs {w!r}"


def assert_trains_like(got: dict[str, Any], want: dict[str, Any], after: int = 0) -> None:
    """Same final weights (within TOL), step count and logged (rank-reduced) metrics; a run resumed at
    step `after` logged only the steps after it."""
    assert got["global_step"] == want["global_step"] == 8
    assert_close_weights(got["weights"], want["weights"])
    for key, what in (("val_loss", "val_loss"), ("loss", "training loss")):
        assert_close_series(got[key], [(s, v) for s, v in want[key] if s > after], what)


# --- equivalence with one process ------------------------------------------------------------------
def test_ddp_matches_single_process(single: Path, main: Launch) -> None:
    one, ddp = single_result(single, "single"), main.result("ddp")
    assert ddp["world_size"] == 2 and one["world_size"] == 1
    assert_equal_weights(ddp["loaded_weights"], one["loaded_weights"])  # the same initial model
    assert max_abs_diff(ddp["weights"], ddp["loaded_weights"]) > 1e-2  # and it trained
    assert_trains_like(ddp, one)
    # The objects alive before fit sat out the collector during the run (a cheap end-of-fit
    # collection) and were handed back after it; a single process leaves the collector alone.
    assert ddp["gc_frozen_in_fit"] > 10_000 and ddp["gc_frozen_after_fit"] == 0
    assert one["gc_frozen_in_fit"] == 0 and one["gc_frozen_after_fit"] == 0

    # The logged val_loss is the mean over both ranks' shards, not rank 0's own: with the final
    # weights, rank 0's half of the validation set alone has another loss.
    import torch.nn.functional as F
    from torch import nn

    model = nn.Sequential(nn.Linear(dist_worker.N_FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    model.load_state_dict(ddp["weights"])
    x, y = dist_worker.make_data(32 + 16, seed=0)
    xv, yv = x[32:], y[32:]
    with torch.no_grad():
        everything = F.mse_loss(model(xv), yv).item()
        rank0_shard = F.mse_loss(model(xv[0::2]), yv[0::2]).item()  # DistributedSampler: rank 0 gets 0, 2, 4, ...
    step, logged = ddp["val_loss"][-1]
    assert step == 8 and math.isclose(logged, everything, rel_tol=1e-5)
    assert not math.isclose(logged, rank0_shard, rel_tol=1e-3)


def test_ddp_shuffled_is_deterministic_and_matches_the_same_data_order(
    single: Path, main: Launch, resume: Launch
) -> None:
    # With shuffle=True a single process draws a RandomSampler permutation from torch's global RNG, while
    # DDP ranks read a DistributedSampler permutation (seeded from config.seed + epoch), so the two runs
    # see different batches and their weights are not comparable. They are comparable where the order
    # is provably the same: a single process reading through DistributedSampler(num_replicas=1,
    # seed=config.seed) draws the same permutation P each epoch (randperm(n) from a generator seeded
    # seed + epoch), and rank r of 2 reads P[r::2] in batches of 4, so step k's two batches together are
    # exactly P[8k:8k+8], the single process's batch k of 8.
    ddp = main.result("ddp_shuffled")
    assert_trains_like(ddp, single_result(single, "single_ddp_order"))

    # The DistributedSampler kept the loader's shuffle: the result differs from the unshuffled run.
    assert max_abs_diff(ddp["weights"], main.result("ddp")["weights"]) > 1e-4

    # Shuffled DDP is deterministic: a second launch reproduces it bit for bit.
    rerun = resume.result("again")
    assert_equal_weights(rerun["weights"], ddp["weights"])
    assert rerun["loss"] == ddp["loss"] and rerun["val_loss"] == ddp["val_loss"]


def test_fsdp_matches_single_process(single: Path, main: Launch) -> None:
    fsdp = main.result("fsdp")
    assert fsdp["world_size"] == 2
    assert_trains_like(fsdp, single_result(single, "single"))


def test_accumulation_matches_single_process_and_syncs_once_per_window(single: Path, main: Launch) -> None:
    # Per-rank batch 2, 2 micro-batches per step: rank r's window k holds samples 8k+r, 8k+r+2 and
    # 8k+r+4, 8k+r+6, so both ranks' windows together are the single process's batch k of 8.
    assert_trains_like(main.result("accum"), single_result(single, "single"))
    # One gradient all-reduce (DDP comm hook call; this small model has one bucket) per window: the
    # first micro-batch runs under no_sync. 16 means every micro-batch synchronised; the result is the
    # same (all-reduce is linear) but the communication is doubled. Note that DDP arms its reducer in
    # forward(): no_sync() must enclose the micro-batch's forward as well as its backward.
    info = main.info("accum")
    assert sorted(info) == [0, 1]
    assert [info[r]["allreduce_calls"] for r in (0, 1)] == [8, 8], info


def test_an_epochs_short_last_accumulation_window_is_all_reduced(single: Path, main: Launch) -> None:
    # Windows of 3, 3 and 2 micro-batches: the short window's second micro-batch ends it, so it runs without
    # no_sync and DDP all-reduces the window. Left under no_sync, each rank steps with its own gradients of
    # that window: the weights leave the one-process run's (by ~0.02) and the ranks' replicas differ.
    got, want = main.result("accum-short"), single_result(single, "single_accum_short")
    assert got["global_step"] == want["global_step"] == 3
    assert_close_weights(got["weights"], want["weights"])
    info = main.info("accum-short")
    assert [info[r]["allreduce_calls"] for r in (0, 1)] == [3, 3], info  # one per window, the short one too


def test_estimated_stepping_batches_counts_the_steps_each_rank_takes(single: Path, main: Launch) -> None:
    # Read in configure_optimizers (before setup would load the loaders): the run's training steps from
    # this rank's share of the data. 32 samples, 2 epochs: one process at batch 8 has 4 batches an epoch,
    # and so has each of two ranks at batch 4; at batch 2 with accumulation 2, 8 batches in 4 windows.
    # One epoch of 8 micro-batches in windows of 3 is 3 steps (the last window short).
    for got, steps in (
        (single_result(single, "single"), 8),
        (main.result("ddp"), 8),
        (main.result("fsdp"), 8),
        (main.result("accum"), 8),
        (main.result("accum-short"), 3),
    ):
        assert got["stepping_batches"] == got["global_step"] == steps, (got["world_size"], got["global_step"])
    # A run resumed from a checkpoint in the middle of an accumulation window counts the whole run again.
    resumed = main.result("accum-mid-resumed")
    assert resumed["start_step"] > 0 and resumed["stepping_batches"] == resumed["global_step"] == 8


def test_a_checkpoint_inside_an_accumulation_window_resumes_each_rank_with_its_own_gradients(main: Launch) -> None:
    # Inside a window DDP has not synchronised yet: each rank's gradients are its own micro-batch's. The
    # checkpoint keeps every rank's (rank 0 writes the file), and each rank resumes with its own: the resumed
    # run ends bit for bit where the uninterrupted one did. With rank 0's gradients on both ranks, the
    # window's all-reduce would count rank 0's first micro-batch twice and lose rank 1's.
    uninterrupted, saving, resumed = (main.result(c) for c in ("accum", "accum-mid", "accum-mid-resumed"))
    state = torch.load(main.root("accum-mid") / "mid-window.ckpt", weights_only=True)
    assert state["counters"]["global_step"] == 5 and state["window"]["pos"] == 1
    per_rank = state["window_per_rank"]
    assert len(per_rank) == 2 and per_rank[0]["pos"] == per_rank[1]["pos"] == 1
    grads0, grads1 = per_rank[0]["grads"]["model"], per_rank[1]["grads"]["model"]
    assert grads0.keys() == grads1.keys() and grads0  # every parameter's gradient, on each rank
    assert not any(torch.equal(grads0[k], grads1[k]) for k in grads0), "the ranks' gradients differ"
    assert all(torch.equal(grads0[k], state["window"]["grads"]["model"][k]) for k in grads0)  # `window`: rank 0's
    assert_equal_weights(saving["weights"], uninterrupted["weights"])  # saving changed nothing
    assert resumed["start_step"] == 5 and resumed["global_step"] == 8
    assert_equal_weights(resumed["weights"], uninterrupted["weights"])


def test_a_checkpoint_inside_an_fsdp_accumulation_window_resumes_bit_for_bit(single: Path, main: Launch) -> None:
    # FSDP2 with its gradient sync off keeps the window's unsharded gradients inside itself, out of the
    # sharded parameters' `p.grad` that a checkpoint saves: the resumed run lost its first micro-batch. The
    # trainer leaves FSDP2's sync on inside a window, so each micro-batch's gradients are reduce-scattered
    # into `p.grad` (each rank its shard of the synchronised gradient), which the checkpoint keeps per rank.
    uninterrupted, saving, resumed = (
        main.result(c) for c in ("fsdp-accum", "fsdp-accum-mid", "fsdp-accum-mid-resumed")
    )
    assert_trains_like(uninterrupted, single_result(single, "single"))  # 2 ranks x 2 micro-batches of 2
    assert_equal_weights(saving["weights"], uninterrupted["weights"])  # saving changed nothing
    assert resumed["start_step"] == 5 and resumed["global_step"] == 8
    assert_equal_weights(resumed["weights"], uninterrupted["weights"])

    ckpt = main.root("fsdp-accum-mid") / "mid-window.ckpt"
    assert (ckpt / ".metadata").is_file()  # the FSDP default: a sharded (DCP) checkpoint directory
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["counters"]["global_step"] == 5 and state["window"]["pos"] == 1
    shards = [entry["grads"]["model"] for entry in state["window_per_rank"]]
    full = uninterrupted["weights"]
    assert len(shards) == 2 and shards[0].keys() == shards[1].keys() == full.keys(), shards
    # Each rank's own shard (rows split over the ranks): together, every parameter's whole gradient.
    assert all(torch.cat([shards[0][k], shards[1][k]]).shape == full[k].shape for k in full)
    assert shards[0]["0.weight"].shape == (8, 8) and shards[0]["0.weight"].abs().sum() > 0


# --- who writes -----------------------------------------------------------------------------------
def test_only_rank_zero_writes_logs_checkpoints_and_prints(single: Path, main: Launch) -> None:
    # Each rank gets its own root_dir (ROOT/rank<R>) only so that what each one writes can be told apart;
    # each rank's standard output (file descriptor 1) during the run went to its own file.
    main.result("writes")
    rank0, rank1 = main.root("writes") / "rank0", main.root("writes") / "rank1"
    written_by_rank1 = [str(p.relative_to(rank1)) for p in rank1.rglob("*")] if rank1.exists() else []
    assert written_by_rank1 == [], f"rank 1 wrote {written_by_rank1}"

    log_dir = rank0 / "run"  # the run directory (run_name="run"): logs, checkpoints/
    assert {"metrics.csv", "metrics.jsonl", "hparams.json"} <= {p.name for p in log_dir.iterdir()}
    assert (rank0 / "run" / "checkpoints" / "last.ckpt").exists()
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    val_rows = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    assert_close_series(val_rows, single_result(single, "single")["val_loss"], "val_loss in metrics.csv")
    assert len({int(r["step"]) for r in rows if r.get("loss")}) == len([r for r in rows if r.get("loss")]) == 8
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("val_loss" in r for r in records)

    out0, out1 = (main.directory / "stdout" / f"rank{r}.stdout" for r in (0, 1))
    assert "epoch 1/2" in out0.read_text() and "epoch 2/2" in out0.read_text()
    assert out1.read_text() == "", f"rank 1 printed: {out1.read_text()[:500]!r}"


def test_a_metric_only_one_rank_logs_is_reduced_over_that_rank(single: Path, main: Launch) -> None:
    # The ranks agree on the union of metric names before reducing (a checksum, then the names only
    # when they differ); rank 0 never logs `rank1_step`, so its mean is rank 1's own values.
    out = main.result("rank_metric")
    # logged at steps 2, 4, ..., 8; at step s it averages rank 1's global_step before steps s-1 and s
    assert out["rank1_step"] == [(s, s - 1.5) for s in (2, 4, 6, 8)]
    one = dict(single_result(single, "single")["loss"])  # one process, logged every step
    assert_close_series(out["loss"], [(s, (one[s - 1] + one[s]) / 2) for s in (2, 4, 6, 8)], "loss")


# --- checkpoints: kill and resume, resharding --------------------------------------------------------
def test_sigkill_one_rank_then_resume_is_bit_exact(main: Launch, resume: Launch) -> None:
    assert not main.out("killed").exists() and main.failed_at("killed", 1)
    assert main.returncode != 0, "torchrun did not report the SIGKILLed rank: " + main.describe()
    assert 1 not in main.info("killed"), "rank 1 ran its teardown: it was not SIGKILLed"
    names = sorted(p.name for p in (main.root("killed") / "run" / "checkpoints").glob("*.ckpt"))
    assert names == ["epoch=0-step=3.ckpt", "last.ckpt"], names

    got, ref = resume.result("killed-resumed"), main.result("ddp_shuffled")
    assert got["start_step"] == 3, "the resumed run did not start from the step-3 checkpoint"
    assert got["global_step"] == 8
    assert_equal_weights(got["weights"], ref["weights"])
    assert got["loss"] == [(s, v) for s, v in ref["loss"] if s > 3]


# (source reference, target strategy). A checkpoint from one strategy/world size loads under another;
# DDP/one process write one file, FSDP a sharded DCP directory (or one file with
# fsdp_sharded_checkpoints=False). The 2-process targets ran in `main`; the 1-process ones run here.
RESHARD = [
    ("ddp", "single"),
    ("single", "ddp"),
    ("ddp", "fsdp"),
    ("fsdp", "ddp"),
    ("fsdp", "single"),
    ("fsdp_file", "single"),
]


@pytest.mark.parametrize(("source", "target"), RESHARD, ids=[f"{s}-to-{t}" for s, t in RESHARD])
def test_checkpoint_loads_across_strategies_and_world_sizes(
    single: Path, main: Launch, tmp_path: Path, source: str, target: str
) -> None:
    src = single_result(single, source) if source == "single" else main.result(source)
    src_root = single / source if source == "single" else main.root(source)
    (ckpt,) = (src_root / "run" / "checkpoints").glob("epoch=*-step=3.ckpt")  # mid-epoch 0, after 3 of 4 batches
    assert ckpt == src_root / STEP3
    saved = src["saved_weights"][3]
    case = f"{source}-to-{target}"
    if target == "single":
        assert dist_worker.main(case_argv(tmp_path, case, ("--epochs", "2", *SINGLE, "--ckpt", str(ckpt)))) == 0
        got, nproc = torch.load(tmp_path / f"{case}.pt", weights_only=True), 1
    else:
        got, nproc = main.result(case), 2
    assert got["world_size"] == nproc
    assert got["start_step"] == 3
    assert_equal_weights(got["loaded_weights"], saved)  # the checkpoint's weights, exactly
    # Training continues where the source stopped: the same batches (the unshuffled order covers the
    # same global samples per step at any world size), momentum from the checkpoint's optimizer state,
    # so it ends like the uninterrupted run.
    assert_trains_like(got, single_result(single, "single"), after=3)


# --- several nodes ----------------------------------------------------------------------------------
def test_two_nodes_on_loopback_match_single_process(single: Path, two_nodes: Launch) -> None:
    assert two_nodes.ok, two_nodes.describe()
    info = two_nodes.info("two-nodes")
    assert sorted(info) == [0, 1]
    assert {info[r]["group_rank"] for r in (0, 1)} == {"0", "1"}, "the ranks did not run on two nodes"
    assert [info[r]["local_rank"] for r in (0, 1)] == [0, 0]
    got = two_nodes.result("two-nodes")
    assert got["world_size"] == 2
    assert_trains_like(got, single_result(single, "single"))


# --- failures ---------------------------------------------------------------------------------------
def test_dead_rank_ends_the_job_instead_of_hanging(after_signal: Launch) -> None:
    run = after_signal
    assert run.returncode != 0, run.describe()
    took = run.ended - run.failed_at("dead", 1)
    assert took < 60, f"the job took {took:.1f} s to end after rank 1 died"
    assert not run.out("dead").exists()
    info = run.info("dead")
    assert 1 not in info  # os._exit: no teardown
    if 0 in info:  # rank 0 failed in a collective (it may also have been stopped by torchrun first)
        assert info[0]["exception"] is not None and info[0]["global_step"] == 5, info[0]


def test_a_rank_stuck_in_c_holding_the_gil_is_named_its_stacks_written_and_the_job_ends(stuck: Launch) -> None:
    # Its watchdog thread and its SIGTERM handler never run: faulthandler's thread writes its stacks and ends
    # it after the verdict; rank 0 files them. Without that, torchrun's SIGKILL came 30 s after its SIGTERM.
    # The bound tells the two apart with room for a loaded machine (13.3 s once, 2 cores and the suite's
    # other workers busy): the verdict after hang_timeout=2, then up to 18 s for the stacks and the ends.
    run = stuck
    assert run.returncode != 0, run.describe()
    took = run.ended - run.failed_at("stuck", 1)
    assert took < 2 + 18, f"the job took {took:.1f} s to end after rank 1 hung in C, with hang_timeout=2"
    lines = [line for line in run.output.splitlines() if line.startswith("dream_trainer: [rank")]
    assert len(lines) == 1 and "rank 1: " in lines[0] and "not responding" in lines[0], run.describe()
    root_cause = run.output[run.output.find("Root Cause") :]
    assert re.search(r"rank\s*:\s*1 ", root_cause), run.describe()  # it ended first
    run_dir = run.root("stuck") / "run"
    stacks = (run_dir / "hang-stacks-rank1.txt").read_text()
    assert stacks.startswith(lines[0].split("] ", 1)[1].join(("dream_trainer: ", "\n"))), stacks[:600]
    assert "in stuck_in_c" in stacks and "in training_step" in stacks, stacks
    assert not list(run_dir.glob(".hang-stacks-*")), sorted(p.name for p in run_dir.iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "hung" and [s["rank"] for s in record["hang"]["stuck"]] == [1], record


def test_a_hung_rank_is_named_and_the_job_ends_within_hang_timeout(unattended: Launch) -> None:
    run = unattended
    assert run.returncode != 0, run.describe()
    took = run.ended - run.failed_at("hung", 1)
    assert took < 2 + 10, f"the job took {took:.1f} s to end after rank 1 hung, with hang_timeout=2"
    lines = [line for line in run.output.splitlines() if line.startswith("dream_trainer: [rank")]
    assert len(lines) == 2 and all("hang: no progress" in line for line in lines), run.describe()  # one per rank
    assert all("rank 1: training_step at global step 5" in line for line in lines), lines
    assert not any("rank 0:" in line for line in lines), lines
    # torchrun's report names the stuck rank as the root cause (it ended first), with the watchdog's line.
    root_cause = run.output[run.output.find("Root Cause") :]
    assert re.search(r"rank\s*:\s*1 ", root_cause) and "HangDetected" in root_cause, run.describe()
    run_dir = run.root("hung") / "run"
    stacks = run_dir / "hang-stacks-rank1.txt"
    assert stacks.exists(), sorted(p.name for p in run_dir.iterdir())
    assert "stuck_in_training_step" in stacks.read_text()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "hung", record
    assert [(s["rank"], s["where"], s["step"]) for s in record["hang"]["stuck"]] == [(1, "training_step", 5)]


def test_sigterm_to_one_rank_stops_every_rank_within_seconds_then_resumes_exactly(
    main: Launch, unattended: Launch
) -> None:
    # Steps of 0.5 s, log_every_n_steps=50 (no logging point in the run): rank 1 alone gets SIGTERM at
    # step 2. The ranks agree through the store on a step none has passed, stop there together and save.
    run = unattended
    info = run.info("sigterm-one")
    assert sorted(info) == [0, 1], run.describe()
    stops = {info[r]["global_step"] for r in (0, 1)}
    assert len(stops) == 1 and all(info[r]["exception"] == "TrainingInterrupted" for r in (0, 1)), info
    stop = stops.pop()
    assert 2 <= stop <= 4, f"stopped at step {stop}, signal at step 2"
    directory = run.root("sigterm-one") / "run" / "checkpoints"
    found = sorted(directory.glob(f"signal-epoch=*-step={stop}.ckpt"))
    assert len(found) == 1, sorted(p.name for p in directory.iterdir())
    ckpt = found[0]
    waited = ckpt.stat().st_mtime - run.failed_at("sigterm-one", 1)
    assert waited < 10, f"the checkpoint came {waited:.1f} s after the signal (steps of 0.5 s)"

    got = run.result("sigterm-resumed")
    assert got["start_step"] == stop and got["global_step"] == 8
    assert_equal_weights(got["weights"], main.result("ddp_shuffled")["weights"])


def test_dead_rank_with_max_restarts_resumes_from_last_checkpoint(main: Launch, restarted: Launch) -> None:
    assert restarted.ok, restarted.describe()
    got = restarted.result("restarted")
    assert got["restart_count"] == "1", "the run was not restarted"
    assert got["start_step"] == 3 and got["global_step"] == 8
    assert_equal_weights(got["weights"], main.result("ddp_shuffled")["weights"])
    assert all(i["restart_count"] == "1" and i["exception"] is None for i in restarted.info("restarted").values())


def test_sigterm_to_torchrun_stops_all_ranks_at_one_step_then_resumes(
    main: Launch, resume: Launch, after_signal: Launch
) -> None:
    # Rank 1 waits for the signal at step 5; rank 0 is then inside step 6, blocked in its gradient
    # all-reduce, and its handler cannot run until that returns. The ranks agree through the watchdog's
    # store (no logging point needed): on a step neither has passed, the end of step 6 (rank 0 is in it),
    # and it is rank 0 that writes the checkpoint.
    assert (resume.directory / "ready").exists(), "the run never reached step 5: " + resume.describe()
    assert resume.returncode != 0, resume.describe()
    info = resume.info("signalled")
    assert sorted(info) == [0, 1], resume.describe()
    assert [(info[r]["global_step"], info[r]["exception"]) for r in (0, 1)] == [(6, "TrainingInterrupted")] * 2
    directory = resume.root("signalled") / "run" / "checkpoints"
    signal_ckpt = directory / "signal-epoch=1-step=6.ckpt"
    assert signal_ckpt.exists(), sorted(p.name for p in directory.iterdir())
    assert os.path.samefile(directory / "last.ckpt", signal_ckpt)
    assert torch.load(signal_ckpt, weights_only=True)["counters"]["global_step"] == 6

    got = after_signal.result("signalled-resumed")
    assert got["start_step"] == 6, "the resumed run did not start from the signal checkpoint"
    assert_equal_weights(got["weights"], main.result("ddp_shuffled")["weights"])


# --- benchmark ----------------------------------------------------------------------------------------
# benchmarks/ddp.py --quick (plain DDP loop vs dream, two torchrun launches) runs once per test run, in
# the benchmark suite's smoke run: tests/test_benchmark_suite.py::test_quick_suite_reports_every_case
# checks its table (plain, dream and dream/plain rows, positive ratios) and its exit status there.

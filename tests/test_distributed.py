"""Distributed training on CPU (gloo) through real `torchrun` launches (DESIGN.md, Distributed and
Checkpoints).

Every case runs `dist_worker.py` (see its docstring for the run and what it writes) in subprocesses:
`python dist_worker.py` for one process, `python -m torch.distributed.run` (= `torchrun`) for several.
The worker's run: a Tanh MLP, SGD with momentum, 32 training samples, 2 epochs, a global batch of 8 (so
4 steps per epoch, 8 in all), 16 validation samples, validation at each epoch end (steps 4 and 8).

Uninterrupted runs that several tests compare against (`REFERENCES`) are computed once per test run
and shared by the xdist workers (a file lock per reference); they also provide the checkpoints the
resharding tests load (steps 3 and 6, `--save-every 3`).

Tolerances: DDP/FSDP against one process agree to float rounding (the same gradients summed in another
order), so 1e-5; a run against a rerun or a resumed run of the *same* launch configuration must be
bit-exact (`torch.equal`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, file_lock, launcher_free_env, torchrun, xdist_shared_dir

pytestmark = pytest.mark.slow  # every test launches torchrun (each launch: ~5-10 s of CPU)

WORKER = Path(__file__).with_name("dist_worker.py")
BENCHMARK = REPO / "benchmarks" / "ddp.py"
TIMEOUT = 120  # seconds for one launch; a launch normally takes 5-15 s
TOL = 1e-5

PLAIN = ("--epochs", "2", "--save-every", "3")
SHUFFLED = ("--shuffle", "--epochs", "2", "--save-every", "3")
SINGLE = ("--batch-size", "8")
DDP = ("--batch-size", "4", "--strategy", "ddp")
FSDP = ("--batch-size", "4", "--strategy", "fsdp")

# name -> (processes, worker arguments)
REFERENCES: dict[str, tuple[int, tuple[str, ...]]] = {
    "single": (1, (*PLAIN, *SINGLE)),
    "ddp": (2, (*PLAIN, *DDP)),
    "fsdp": (2, (*PLAIN, *FSDP)),  # sharded (DCP directory) checkpoints, the FSDP default
    "fsdp_file": (2, (*PLAIN, *FSDP, "--fsdp-full-checkpoints")),  # gathered single-file checkpoints
    "ddp_shuffled": (2, (*SHUFFLED, *DDP)),
    "single_ddp_order": (1, (*SHUFFLED, *SINGLE, "--ddp-order")),
}


# --- launching ------------------------------------------------------------------------------------
def worker_env() -> dict[str, str]:
    """This environment minus anything a surrounding torchrun set, plus the repo on PYTHONPATH."""
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def command(nproc: int, args: tuple[str, ...] | list[str], launcher_args: tuple[str, ...] = ()) -> list[str]:
    if nproc == 1 and not launcher_args:
        return [sys.executable, str(WORKER), *args]
    return [*torchrun("--standalone", "--nproc_per_node", str(nproc), *launcher_args), str(WORKER), *args]


@dataclass
class Run:
    proc: subprocess.CompletedProcess[str]
    seconds: float
    root: Path
    out: Path
    info_dir: Path

    @property
    def ok(self) -> bool:
        return self.proc.returncode == 0

    def describe(self) -> str:
        p = self.proc
        return (
            f"exit code {p.returncode} after {self.seconds:.1f} s\n--- stdout\n{p.stdout[-4000:]}\n"
            f"--- stderr\n{p.stderr[-6000:]}"
        )

    def result(self) -> dict[str, Any]:
        assert self.out.exists(), "rank 0 wrote no result: " + self.describe()
        return torch.load(self.out, weights_only=True)

    def info(self) -> dict[int, dict[str, Any]]:
        """Each rank's `rank<R>.json` (written in teardown; missing for a rank that was SIGKILLed)."""
        return {int(p.stem[4:]): json.loads(p.read_text()) for p in self.info_dir.glob("rank*.json")}


def launch(
    root: Path,
    args: tuple[str, ...] | list[str],
    nproc: int = 2,
    launcher_args: tuple[str, ...] = (),
    tag: str = "",
    timeout: float = TIMEOUT,
    env: dict[str, str] | None = None,
) -> Run:
    """One launch writing to `root` (a second launch with the same root resumes there)."""
    out, info_dir = root.parent / f"{root.name}{tag}.pt", root.parent / f"{root.name}{tag}-info"
    full = ["--root-dir", str(root), "--out", str(out), "--info-dir", str(info_dir), *args]
    start = time.monotonic()
    proc = subprocess.run(
        command(nproc, full, launcher_args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**worker_env(), **(env or {})},
    )
    return Run(proc, time.monotonic() - start, root, out, info_dir)


# --- the shared references --------------------------------------------------------------------------
class References:
    """Uninterrupted runs, each launched at most once per test run (and by one xdist worker)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._loaded: dict[str, dict[str, Any]] = {}

    def root(self, name: str) -> Path:
        return self.directory / name

    def get(self, name: str) -> dict[str, Any]:
        if name not in self._loaded:
            nproc, args = REFERENCES[name]
            root = self.root(name)
            with file_lock(self.directory / f"{name}.lock"):
                if not (self.directory / f"{name}.pt").exists():
                    run = launch(root, args, nproc=nproc)
                    assert run.ok, f"reference run {name!r} failed: " + run.describe()
            self._loaded[name] = torch.load(self.directory / f"{name}.pt", weights_only=True)
        return self._loaded[name]

    def checkpoint(self, name: str, step: int) -> Path:
        self.get(name)
        (path,) = (self.root(name) / "run" / "checkpoints").glob(f"epoch=*-step={step}.ckpt")
        return path


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The reference runs, in a directory shared by this test run's xdist workers (never across runs)."""
    return References(xdist_shared_dir(tmp_path_factory, "distributed-ref"))


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- equivalence with one process ------------------------------------------------------------------
def test_ddp_matches_single_process(refs: References) -> None:
    single, ddp = refs.get("single"), refs.get("ddp")
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert_equal_weights(ddp["loaded_weights"], single["loaded_weights"])  # the same initial model
    assert max_abs_diff(ddp["weights"], ddp["loaded_weights"]) > 1e-2  # and it trained
    assert_trains_like(ddp, single)
    # The objects alive before fit sat out the collector during the run (a cheap end-of-fit
    # collection) and were handed back after it; a single process leaves the collector alone.
    assert ddp["gc_frozen_in_fit"] > 10_000 and ddp["gc_frozen_after_fit"] == 0
    assert single["gc_frozen_in_fit"] == 0 and single["gc_frozen_after_fit"] == 0

    # The logged val_loss is the mean over both ranks' shards, not rank 0's own: with the final
    # weights, rank 0's half of the validation set alone has another loss.
    import torch.nn.functional as F
    from dist_worker import N_FEATURES, make_data
    from torch import nn

    model = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    model.load_state_dict(ddp["weights"])
    x, y = make_data(32 + 16, seed=0)
    xv, yv = x[32:], y[32:]
    with torch.no_grad():
        everything = F.mse_loss(model(xv), yv).item()
        rank0_shard = F.mse_loss(model(xv[0::2]), yv[0::2]).item()  # DistributedSampler: rank 0 gets 0, 2, 4, ...
    step, logged = ddp["val_loss"][-1]
    assert step == 8 and math.isclose(logged, everything, rel_tol=1e-5)
    assert not math.isclose(logged, rank0_shard, rel_tol=1e-3)


def test_ddp_shuffled_is_deterministic_and_matches_the_same_data_order(refs: References, tmp_path: Path) -> None:
    # With shuffle=True a single process draws a RandomSampler permutation from torch's global RNG, while
    # DDP ranks read a DistributedSampler permutation (seeded from config.seed + epoch), so the two runs
    # see different batches and their weights are not comparable. They are comparable where the order
    # is provably the same: a single process reading through DistributedSampler(num_replicas=1,
    # seed=config.seed) draws the same permutation P each epoch (randperm(n) from a generator seeded
    # seed + epoch), and rank r of 2 reads P[r::2] in batches of 4, so step k's two batches together are
    # exactly P[8k:8k+8], the single process's batch k of 8.
    ddp = refs.get("ddp_shuffled")
    assert_trains_like(ddp, refs.get("single_ddp_order"))

    # The DistributedSampler kept the loader's shuffle: the result differs from the unshuffled run.
    assert max_abs_diff(ddp["weights"], refs.get("ddp")["weights"]) > 1e-4

    # Shuffled DDP is deterministic: a second launch reproduces it bit for bit.
    again = launch(tmp_path / "again", REFERENCES["ddp_shuffled"][1])
    assert again.ok, again.describe()
    rerun = again.result()
    assert_equal_weights(rerun["weights"], ddp["weights"])
    assert rerun["loss"] == ddp["loss"] and rerun["val_loss"] == ddp["val_loss"]


def test_fsdp_matches_single_process(refs: References) -> None:
    fsdp = refs.get("fsdp")
    assert fsdp["world_size"] == 2
    assert_trains_like(fsdp, refs.get("single"))


def test_accumulation_matches_single_process_and_syncs_once_per_window(refs: References, tmp_path: Path) -> None:
    # Per-rank batch 2, 2 micro-batches per step: rank r's window k holds samples 8k+r, 8k+r+2 and
    # 8k+r+4, 8k+r+6, so both ranks' windows together are the single process's batch k of 8.
    args = ("--epochs", "2", "--batch-size", "2", "--accum", "2", "--strategy", "ddp", "--count-allreduce")
    run = launch(tmp_path / "accum", args)
    assert run.ok, run.describe()
    assert_trains_like(run.result(), refs.get("single"))
    # One gradient all-reduce (DDP comm hook call; this small model has one bucket) per window: the
    # first micro-batch runs under no_sync. 16 means every micro-batch synchronised; the result is the
    # same (all-reduce is linear) but the communication is doubled. Note that DDP arms its reducer in
    # forward(): no_sync() must enclose the micro-batch's forward as well as its backward.
    info = run.info()
    assert sorted(info) == [0, 1]
    assert [info[r]["allreduce_calls"] for r in (0, 1)] == [8, 8], info


# --- who writes -----------------------------------------------------------------------------------
def test_only_rank_zero_writes_logs_checkpoints_and_prints(refs: References, tmp_path: Path) -> None:
    # Each rank gets its own root_dir (ROOT/rank<R>) only so that what each one writes can be told apart;
    # torchrun's --redirects puts each rank's stdout/stderr in its own file.
    logs = tmp_path / "torchrun-logs"
    run = launch(
        tmp_path / "run",
        (*PLAIN, *DDP, "--per-rank-root", "--file-loggers", "--verbose"),
        launcher_args=("--redirects", "3", "--log-dir", str(logs)),
    )
    assert run.ok, run.describe()
    rank0, rank1 = tmp_path / "run" / "rank0", tmp_path / "run" / "rank1"
    written_by_rank1 = [str(p.relative_to(rank1)) for p in rank1.rglob("*")] if rank1.exists() else []
    assert written_by_rank1 == [], f"rank 1 wrote {written_by_rank1}"

    log_dir = rank0 / "run"  # the run directory (run_name="run"): logs, checkpoints/
    assert {"metrics.csv", "metrics.jsonl", "hparams.json"} <= {p.name for p in log_dir.iterdir()}
    assert (rank0 / "run" / "checkpoints" / "last.ckpt").exists()
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    val_rows = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    assert_close_series(val_rows, refs.get("single")["val_loss"], "val_loss in metrics.csv")
    assert len({int(r["step"]) for r in rows if r.get("loss")}) == len([r for r in rows if r.get("loss")]) == 8
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert any("val_loss" in r for r in records)

    (out0,) = logs.glob("*/attempt_0/0/stdout.log")
    (out1,) = logs.glob("*/attempt_0/1/stdout.log")
    assert "epoch 1/2" in out0.read_text() and "epoch 2/2" in out0.read_text()
    assert out1.read_text() == "", f"rank 1 printed: {out1.read_text()[:500]!r}"


def test_a_metric_only_one_rank_logs_is_reduced_over_that_rank(refs: References, tmp_path: Path) -> None:
    # The ranks agree on the union of metric names before reducing (a checksum, then the names only
    # when they differ); rank 0 never logs `rank1_step`, so its mean is rank 1's own values.
    run = launch(tmp_path / "run", (*PLAIN, *DDP, "--log-every", "2", "--rank-metric"))
    assert run.ok, run.describe()
    out = torch.load(run.out, weights_only=True)
    # logged at steps 2, 4, ..., 8; at step s it averages rank 1's global_step before steps s-1 and s
    assert out["rank1_step"] == [(s, s - 1.5) for s in (2, 4, 6, 8)]
    single = dict(refs.get("single")["loss"])  # one process, logged every step
    assert_close_series(out["loss"], [(s, (single[s - 1] + single[s]) / 2) for s in (2, 4, 6, 8)], "loss")


# --- checkpoints: kill and resume, resharding --------------------------------------------------------
def test_sigkill_one_rank_then_resume_is_bit_exact(refs: References, tmp_path: Path) -> None:
    args = (*SHUFFLED, *DDP)
    root = tmp_path / "run"
    killed = launch(root, (*args, "--kill-rank", "1", "--kill-at-step", "5", "--kill-how", "sigkill"), tag="-killed")
    assert killed.proc.returncode != 0, "torchrun did not report the SIGKILLed rank: " + killed.describe()
    assert 1 not in killed.info(), "rank 1 ran its teardown: it was not SIGKILLed"
    names = sorted(p.name for p in (root / "run" / "checkpoints").glob("*.ckpt"))
    assert names == ["epoch=0-step=3.ckpt", "last.ckpt"], names

    resumed = launch(root, (*args, "--resume"), tag="-resumed")
    assert resumed.ok, resumed.describe()
    got, ref = resumed.result(), refs.get("ddp_shuffled")
    assert got["start_step"] == 3, "the resumed run did not start from the step-3 checkpoint"
    assert got["global_step"] == 8
    assert_equal_weights(got["weights"], ref["weights"])
    assert got["loss"] == [(s, v) for s, v in ref["loss"] if s > 3]


# (source reference, target strategy). A checkpoint from one strategy/world size loads under another;
# DDP/one process write one file, FSDP a sharded DCP directory (or one file with
# fsdp_sharded_checkpoints=False).
RESHARD = [
    ("ddp", "single"),
    ("single", "ddp"),
    ("ddp", "fsdp"),
    ("fsdp", "ddp"),
    ("fsdp", "single"),
    ("fsdp_file", "single"),
]
TARGETS = {"single": (1, SINGLE), "ddp": (2, DDP), "fsdp": (2, FSDP)}


@pytest.mark.parametrize(("source", "target"), RESHARD, ids=[f"{s}-to-{t}" for s, t in RESHARD])
def test_checkpoint_loads_across_strategies_and_world_sizes(
    refs: References, tmp_path: Path, source: str, target: str
) -> None:
    ckpt = refs.checkpoint(source, 3)  # mid-epoch 0, after 3 of its 4 batches
    saved = refs.get(source)["saved_weights"][3]
    nproc, target_args = TARGETS[target]
    run = launch(tmp_path / "run", ("--epochs", "2", *target_args, "--ckpt", str(ckpt)), nproc=nproc)
    assert run.ok, run.describe()
    got = run.result()
    assert got["world_size"] == nproc
    assert got["start_step"] == 3
    assert_equal_weights(got["loaded_weights"], saved)  # the checkpoint's weights, exactly
    # Training continues where the source stopped: the same batches (the unshuffled order covers the
    # same global samples per step at any world size), momentum from the checkpoint's optimizer state,
    # so it ends like the uninterrupted run.
    assert_trains_like(got, refs.get("single"), after=3)


# --- several nodes ----------------------------------------------------------------------------------
def test_two_nodes_on_loopback_match_single_process(refs: References, tmp_path: Path) -> None:
    # Two torchrun agents ("nodes") of one process each meet at a c10d rendezvous on 127.0.0.1. c10d
    # ignores --node_rank (it assigns node ranks in arrival order); --local-addr keeps the workers'
    # process group on the loopback interface.
    port = free_port()
    root, out, info_dir = tmp_path / "run", tmp_path / "run.pt", tmp_path / "info"
    worker_args = ["--root-dir", str(root), "--out", str(out), "--info-dir", str(info_dir), *PLAIN, *DDP]
    agents = []
    for node in (0, 1):
        launcher = torchrun(
            "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"two-nodes-{port}", "--local-addr", "127.0.0.1",
        )  # fmt: skip
        agents.append(
            subprocess.Popen(
                [*launcher, str(WORKER), *worker_args],
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
    for node, (agent, output) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node}: exit code {agent.returncode}\n{output[-5000:]}"
    info = {int(p.stem[4:]): json.loads(p.read_text()) for p in info_dir.glob("rank*.json")}
    assert sorted(info) == [0, 1]
    assert {info[r]["group_rank"] for r in (0, 1)} == {"0", "1"}, "the ranks did not run on two nodes"
    assert [info[r]["local_rank"] for r in (0, 1)] == [0, 0]
    got = torch.load(out, weights_only=True)
    assert got["world_size"] == 2
    assert_trains_like(got, refs.get("single"))


# --- failures ---------------------------------------------------------------------------------------
def test_dead_rank_ends_the_job_instead_of_hanging(tmp_path: Path) -> None:
    run = launch(
        tmp_path / "run",
        (*SHUFFLED, *DDP, "--timeout", "30", "--kill-rank", "1", "--kill-at-step", "5", "--kill-how", "exit"),
        timeout=90,
    )
    assert run.proc.returncode != 0, run.describe()
    assert run.seconds < 60, f"the job took {run.seconds:.1f} s to end after rank 1 died"
    assert not run.out.exists()
    info = run.info()
    assert 1 not in info  # os._exit: no teardown
    if 0 in info:  # rank 0 failed in a collective (it may also have been stopped by torchrun first)
        assert info[0]["exception"] is not None and info[0]["global_step"] == 5, info[0]


def test_stuck_rank_fails_the_job_after_process_group_timeout(tmp_path: Path) -> None:
    # Rank 1 stays alive but stops taking part in collectives: only process_group_timeout (8 s) can end
    # rank 0's wait; then torchrun stops the stuck rank.
    run = launch(
        tmp_path / "run",
        (*PLAIN, *DDP, "--timeout", "8", "--kill-rank", "1", "--kill-at-step", "3", "--kill-how", "hang"),
        timeout=90,
    )
    assert run.proc.returncode != 0, run.describe()
    assert run.seconds < 50, f"the job took {run.seconds:.1f} s with process_group_timeout=8"
    info = run.info()
    assert info[0]["exception"] is not None and info[0]["global_step"] == 3, info
    assert "timed out" in (run.proc.stdout + run.proc.stderr).lower(), run.describe()


@pytest.mark.parametrize("store", ["shared", "per-round"])
def test_dead_rank_with_max_restarts_resumes_from_last_checkpoint(refs: References, tmp_path: Path, store: str) -> None:
    # torchrun restarts the whole worker group once; the worker kills rank 1 only on the first attempt
    # (TORCHELASTIC_RESTART_COUNT == 0) and every attempt uses resume_from="last".
    # "shared": torchrun's default, where the restarted workers' process group meets in the same TCPStore
    # as the first attempt's (the rendezvous store is shared and reused across rounds, and nothing
    # prefixes it per attempt), so the first attempt's keys are still there; "per-round": a fresh store
    # per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    args = (*SHUFFLED, *DDP, "--timeout", "30", "--resume-from", "last")
    kill = ("--kill-rank", "1", "--kill-at-step", "5", "--kill-how", "exit", "--kill-first-attempt-only")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if store == "per-round" else {}
    run = launch(tmp_path / "run", (*args, *kill), launcher_args=("--max-restarts", "1"), env=env)
    assert run.ok, run.describe()
    got = run.result()
    assert got["restart_count"] == "1", "the run was not restarted"
    assert got["start_step"] == 3 and got["global_step"] == 8
    assert_equal_weights(got["weights"], refs.get("ddp_shuffled")["weights"])
    assert all(i["restart_count"] == "1" and i["exception"] is None for i in run.info().values())


def test_sigterm_to_torchrun_stops_all_ranks_at_one_step_then_resumes(refs: References, tmp_path: Path) -> None:
    # Rank 1 waits for the signal at step 5; rank 0 is then blocked in the agreement all-reduce after
    # step 5 and gets the signal while blocked, so only the agreement (log_every_n_steps=1) makes it stop
    # at step 5 too, and it is rank 0 that writes the checkpoint.
    args = (*SHUFFLED, *DDP, "--log-every", "1")
    root, ready = tmp_path / "run", tmp_path / "ready"
    info_dir = tmp_path / "info"
    wait = ("--wait-for-signal-rank", "1", "--wait-for-signal-at-step", "5", "--ready-file", str(ready))
    full = ["--root-dir", str(root), "--info-dir", str(info_dir), *args, *wait]
    start = time.monotonic()
    agent = subprocess.Popen(
        command(2, full), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env()
    )
    try:
        while not ready.exists():
            assert agent.poll() is None, f"the run ended before step 5: {agent.communicate()[0][-5000:]}"
            assert time.monotonic() - start < TIMEOUT, "the run never reached step 5"
            time.sleep(0.05)
        agent.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to its workers
        output = agent.communicate(timeout=60)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode != 0, output[-5000:]

    info = {int(p.stem[4:]): json.loads(p.read_text()) for p in info_dir.glob("rank*.json")}
    assert sorted(info) == [0, 1], output[-5000:]
    assert [(info[r]["global_step"], info[r]["exception"]) for r in (0, 1)] == [(5, "TrainingInterrupted")] * 2
    directory = root / "run" / "checkpoints"
    signal_ckpt = directory / "signal-epoch=1-step=5.ckpt"
    assert signal_ckpt.exists(), sorted(p.name for p in directory.iterdir())
    assert os.path.samefile(directory / "last.ckpt", signal_ckpt)
    assert torch.load(signal_ckpt, weights_only=True)["counters"]["global_step"] == 5

    resumed = launch(root, (*args, "--resume"), tag="-resumed")
    assert resumed.ok, resumed.describe()
    got = resumed.result()
    assert got["start_step"] == 5, "the resumed run did not start from the signal checkpoint"
    assert_equal_weights(got["weights"], refs.get("ddp_shuffled")["weights"])


# --- benchmark ----------------------------------------------------------------------------------------
def test_ddp_benchmark_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick"], capture_output=True, text=True, timeout=180, env=worker_env()
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in proc.stdout.splitlines() if line[:2] == "| "}
    assert {"plain", "dream", "dream/plain"} <= set(rows), proc.stdout
    assert all(float(cell.strip().rstrip("x")) > 0 for cell in rows["dream/plain"]), proc.stdout

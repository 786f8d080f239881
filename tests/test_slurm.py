"""SLURM as a launcher and a requeueing scheduler, against a real slurmctld + slurmd on 127.0.0.1.

The `slurm` fixture starts one Slurm for the test session (xdist group "slurm": the tests share it),
from a minimal slurm.conf in a temporary directory (auth/none, no cgroups, one node "localhost"), and
skips when Slurm is not installed (`apt-get install slurm-wlm`). Jobs run `tests/slurm_worker.py`:

- `srun --ntasks=2 python slurm_worker.py` (no torchrun) is one run of world size 2;
- the sbatch script of docs/unattended.md, as written (the flags a one-node test machine needs are
  given on sbatch's command line, which overrides the script's): `scancel --signal=USR1` -> the
  checkpoint, run.json "requeued", the job requeued by the trainer, and the second start resumes and
  ends with the weights of an uninterrupted run;
- the same script with `--no-requeue`: one line says the job cannot requeue; the run is "interrupted".
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import slurm_worker
import torch

from dream_trainer.cli.runs import list_runs

TESTS = Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "unattended.md"

pytestmark = pytest.mark.slow


@dataclass
class Slurm:
    env: dict[str, str]
    logs: Path

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout, check=check)

    def sbatch(self, script: Path, *flags: str) -> str:
        return self.run("sbatch", "--parsable", *flags, str(script)).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        shown = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def diagnosis(self) -> str:
        tails = [
            f"{p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in self.logs.glob("*.log")
        ]
        return "\n".join(tails)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _slurm_conf(d: Path, user: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=dreamtest
SlurmctldHost=localhost
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
# A requeued job may start again once its credential expired: 5 s, not 120.
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
InactiveLimit=0
MinJobAge=600
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/logs/slurmctld.log
SlurmdLogFile={d}/logs/slurmd.log
# More CPUs than the machine has, so the tests' jobs never wait for each other.
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the test process dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    missing = [name for name in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not on PATH): apt-get install slurm-wlm")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "logs"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, getpass.getuser(), *_free_ports(2)))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in list(env):  # this process may itself run under Slurm: its jobs must not inherit that
        if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
            del env[name]
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "preexec_fn": _die_with_parent}
    daemons = [
        subprocess.Popen(["slurmctld", "-D", "-i"], **quiet),
        subprocess.Popen(["slurmd", "-D", "-N", "localhost"], **quiet),
    ]
    cluster = Slurm(env, d / "logs")
    try:
        deadline = time.monotonic() + 30
        while cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip() != "idle":
            if time.monotonic() > deadline or any(p.poll() is not None for p in daemons):
                pytest.fail(f"the test's Slurm did not start (slurm.conf: {conf}):\n{cluster.diagnosis()}")
            time.sleep(0.2)
        yield cluster
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(what: str, done: Callable[[], bool], timeout: float, slurm: Slurm, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace") if log is not None and log.exists() else "(no job log)"
            pytest.fail(f"timed out waiting for {what}; job log:\n{text}\n{slurm.diagnosis()}")
        time.sleep(0.1)


def _record(root: Path) -> dict:
    try:
        return json.loads((root / slurm_worker.RUN_NAME / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _doc_script() -> str:
    """The sbatch script of docs/unattended.md's SLURM section (the bash block with #SBATCH --requeue)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    (script,) = [b for b in blocks if b.startswith("#!/bin/bash") and "#SBATCH --requeue" in b]
    return script


def _job_dir(tmp_path: Path, pace: float, steps: int = 24) -> tuple[Path, Path]:
    """A directory holding the doc's script as `job.sh` and a `train.py` that runs the worker."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "job.sh").write_text(_doc_script())
    (tmp_path / "train.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom slurm_worker import main\n"
        f"main(['--out', {str(out)!r}, '--pace', '{pace}', '--steps', '{steps}'])\n"
    )
    return tmp_path / "job.sh", out


# The doc's script asks for 8 GPUs and 8 tasks a node; this machine runs one task without a GPU.
ONE_CPU_TASK = ("--ntasks-per-node=1", "--gpus-per-node=0")


def test_srun_without_torchrun_is_one_run_of_world_size_two(slurm: Slurm, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    worker = str(TESTS / "slurm_worker.py")
    done = slurm.run(
        "srun", "--ntasks=2", f"--chdir={tmp_path}", sys.executable, worker, "--out", str(out), "--steps", "4",
        check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [p.name for p in (tmp_path / "runs").iterdir() if (p / "run.json").exists()]
    assert runs == [slurm_worker.RUN_NAME]
    record = _record(tmp_path / "runs")
    assert record["world_size"] == 2 and record["status"] == "success"
    facts = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(f["rank"], f["world"], f["step"]) for f in facts] == [(0, 2, 4), (1, 2, 4)]
    assert facts[0]["run_dir"] == facts[1]["run_dir"]
    a, b = (torch.load(out / f"final-rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert done.stderr.count("2 tasks from srun (ranks from SLURM_PROCID") == 1, done.stderr


def _reference(tmp_path: Path, steps: int) -> dict[str, torch.Tensor]:
    """The weights of the same run, uninterrupted, in this process (one thread, as the worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = slurm_worker.Regression(slurm_worker.config(str(tmp_path / "reference"), steps, []))
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    return trainer.model.state_dict()


def test_the_time_limit_signal_checkpoints_requeues_and_the_job_resumes_exactly(slurm: Slurm, tmp_path: Path) -> None:
    # The doc's script with a one-minute time limit and the signal 50 s before it. slurmctld checks time
    # limits every 30 s, so SIGUSR1 comes 10-40 s after the start (not during Python's start-up, before
    # fit() installs the handler): the first start (0.2 s a step) trains for longer than that. The requeued
    # start (full speed, a new minute) ends before it is signalled.
    steps = 240
    script, out = _job_dir(tmp_path, pace=0.2, steps=steps)
    limit = ("--time=1", "--signal=USR1@50")  # sbatch's command line wins over the script's #SBATCH lines
    job = slurm.sbatch(script, f"--chdir={tmp_path}", *ONE_CPU_TASK, *limit)
    log = tmp_path / f"train-{job}.log"  # the doc script's --output

    _wait('run.json status "requeued"', lambda: _record(tmp_path / "runs").get("status") == "requeued", 60, slurm, log)
    (row,) = list_runs(tmp_path / "runs")
    assert row.status == "requeued" and f"requeued SLURM job {job}" in row.ended
    assert 2 <= int(row.step) < steps, row
    # Slurm starts the requeued job once the first start's credential expired (cred_expire=5 here).
    _wait("the requeued job to finish", lambda: slurm.job(job).get("JobState") == "COMPLETED", 60, slurm, log)

    assert slurm.job(job)["Restarts"] == "1"
    text = log.read_text()
    assert text.count(f"requeued SLURM job {job}") == 1, text
    assert "stopped by SIGUSR1 at global step" in text and "continuing run" in text, text
    record = _record(tmp_path / "runs")
    assert record["status"] == "success" and [r["outcome"] for r in record["resumes"]] == ["success"]
    assert [row.step for row in list_runs(tmp_path / "runs")] == [str(steps)]
    final = torch.load(out / "final-rank0.pt")
    reference = _reference(tmp_path, steps)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_a_job_submitted_without_requeue_says_it_cannot_requeue(slurm: Slurm, tmp_path: Path) -> None:
    script, out = _job_dir(tmp_path, pace=0.25)
    job = slurm.sbatch(script, f"--chdir={tmp_path}", *ONE_CPU_TASK, "--no-requeue")
    log = tmp_path / f"train-{job}.log"
    _wait("the second step", (out / "started").exists, 60, slurm, log)
    slurm.run("scancel", "--signal=USR1", job)
    _wait("the job to end", lambda: slurm.job(job).get("JobState") in ("FAILED", "COMPLETED"), 60, slurm, log)

    lines = [line for line in log.read_text().splitlines() if "requeue" in line]
    assert len(lines) == 1, lines
    assert f"cannot requeue SLURM job {job}: it was submitted without --requeue" in lines[0]
    assert lines[0].startswith("dream_trainer: stopped by SIGUSR1 at global step")
    record = _record(tmp_path / "runs")
    assert record["status"] == "interrupted"
    assert list((tmp_path / "runs" / slurm_worker.RUN_NAME / "checkpoints").glob("signal-*.ckpt"))
    assert slurm.job(job)["Restarts"] == "0"

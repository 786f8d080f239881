"""SLURM: the ranks of a job step `srun` started without `torchrun`, and requeueing the job.

`srun --ntasks=N python train.py` starts N processes and tells each who it is through SLURM's
variables, not torchrun's. `srun_tasks` reads them (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` or
`SLURM_NTASKS`, `SLURM_LOCALID`), and `adopt_srun_tasks` writes what torchrun would have set (`RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), so the process group's `env://` rendezvous,
and any library that reads them, sees the same world. Only inside a job step (`SLURM_STEP_ID` is set:
a batch script's own shell and an `salloc` shell are not steps, so `python train.py` there stays one
process) and only when torchrun's variables are absent (`srun torchrun ...` is torchrun's world).

`requeue` puts the running job back in the queue (`scontrol requeue`), or says in one phrase why it
cannot; `can_requeue` only asks (the trainer prints its line in between: srun, which carries the step's
output to the job's log, ends as soon as the job is requeued).

`launcher_hazard` says when a process srun started above this one (torchrun, a shell) would die of
a signal Slurm sends the step. Slurm signals the task srun started, and on most clusters only it
(proctrack/cgroup signals the step's tasks, proctrack/pgid their process group; torchrun's ranks run in
sessions of their own): torchrun catches SIGTERM and passes it on to its ranks, but SIGUSR1 ends it at
once, and Slurm then kills the ranks, without a checkpoint. Nothing here knows about the trainer;
`dream_trainer.mixins.distributed` and `.signals` use it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

__all__ = [
    "SlurmTasks",
    "StepProcess",
    "adopt_srun_tasks",
    "can_requeue",
    "first_host",
    "job_id",
    "launcher_hazard",
    "master_port",
    "requeue",
    "srun_tasks",
    "step_ancestors",
]

# Any of these: a launcher (torchrun, or the user) already said who this process is.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
_SCONTROL_TIMEOUT = 20.0  # seconds; the grace period --signal=USR1@N gives is for the save, not a hung controller


@dataclass(frozen=True)
class SlurmTasks:
    """Who this process is in a job step `srun` started."""

    job_id: str
    step_id: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def env(self) -> dict[str, str]:
        """The variables torchrun would have set for this process."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in (`SLURM_JOB_ID`), or None outside SLURM."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def srun_tasks(environ: Mapping[str, str] | None = None) -> SlurmTasks | None:
    """This process's place in an `srun` job step of several tasks, from SLURM's variables; None when
    torchrun's variables are set, outside a job step, or in a step of one task (nothing to do)."""
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in TORCHRUN_VARIABLES):
        return None
    job, step = job_id(env), env.get("SLURM_STEP_ID")
    if job is None or step is None or env.get("SLURM_PROCID") is None:
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return None
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return SlurmTasks(
        job_id=job,
        step_id=step,
        rank=int(env["SLURM_PROCID"]),
        world_size=world,
        local_rank=int(env.get("SLURM_LOCALID") or 0),
        # Task 0 runs on the step's first node, whatever the distribution (block or cyclic).
        master_addr=env.get("MASTER_ADDR") or first_host(nodes) or "127.0.0.1",
        master_port=int(env.get("MASTER_PORT") or master_port(job, step)),
    )


def adopt_srun_tasks(environ: MutableMapping[str, str] | None = None) -> SlurmTasks | None:
    """Under `srun` without torchrun: set torchrun's variables from SLURM's (see the module) and return
    the tasks; None (nothing changed) otherwise. `MASTER_ADDR`/`MASTER_PORT` given by the user stay."""
    env = os.environ if environ is None else environ
    tasks = srun_tasks(env)
    if tasks is not None:
        env.update(tasks.env())
    return tasks


def master_port(job: str, step: str = "0") -> int:
    """The rendezvous port of a job step: 15000-31999, from the job and step ids, so every task of the
    step computes the same one and two steps (or jobs) on one node rarely meet. Below Linux's
    ephemeral range (32768-60999), where the kernel picks client ports."""
    digits = int(re.sub(r"\D", "", job) or 0)
    step_number = int(step) if step.isdigit() else 0
    return 15000 + (digits * 16 + step_number) % 17000


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, as `scontrol show hostnames` would print it first:
    `"gpu[003-010,017],cpu1"` -> `"gpu003"`, `"rack[1-2]-n[01-04]"` -> `"rack1-n01"`."""
    out = []
    depth = 0
    i = 0
    while i < len(nodelist):
        c = nodelist[i]
        if c == "," and depth == 0:
            break
        if c == "[":
            close = nodelist.find("]", i)
            if close < 0:
                break
            first_range = nodelist[i + 1 : close].split(",")[0]
            out.append(first_range.split("-")[0])  # zero padding kept: "003-010" -> "003"
            i = close + 1
            continue
        out.append(c)
        i += 1
    return "".join(out).strip()


def can_requeue(job: str) -> tuple[bool, str]:
    """Whether the running job `job` can be put back in the queue (`scontrol show job`): `(True, the phrase
    saying it is requeued)`, or `(False, why it cannot)`. Not requeued: a job submitted without `--requeue`
    (Requeue=0), and a job that is no longer RUNNING (being cancelled, or at its time limit)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, f"cannot requeue SLURM job {job}: no scontrol on this node's PATH"
    try:
        shown = subprocess.run(
            [scontrol, "show", "job", job], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        return False, f"cannot requeue SLURM job {job}: scontrol did not answer within {_SCONTROL_TIMEOUT:.0f} s"
    except OSError as exc:
        return False, f"cannot requeue SLURM job {job}: scontrol failed to start ({exc.strerror or exc})"
    flag = re.search(r"\bRequeue=(\d+)", shown.stdout)
    if flag is not None and flag.group(1) == "0":
        return False, (
            f"cannot requeue SLURM job {job}: it was submitted without --requeue (scontrol show job: "
            "Requeue=0); submit with sbatch --requeue"
        )
    # A job `scancel` (or the time limit itself) is ending is no longer RUNNING: requeueing it would
    # bring back a job its user cancelled. A signal sent before the limit (--signal) finds it RUNNING.
    state = re.search(r"\bJobState=(\w+)", shown.stdout)
    if state is not None and state.group(1) != "RUNNING":
        return False, (
            f"cannot requeue SLURM job {job}: it is ending (JobState={state.group(1)}: cancelled, or at its "
            "time limit); requeue before the limit with --signal=USR1@120"
        )
    return True, f'requeued SLURM job {job}: it starts again, and resume_from="last" continues from this checkpoint'


def requeue(job: str, checked: bool = False) -> tuple[bool, str]:
    """Put the running job `job` back in the queue (`scontrol requeue`): `(True, what happened)`, or
    `(False, why it cannot)`. Slurm then ends the job's processes (SIGTERM now, SIGKILL after its
    KillWait) and starts the job again; srun, which carries the job step's output to the job's log, ends
    within milliseconds: a line the step prints after this call is lost. `checked`: `can_requeue(job)`
    said yes a moment ago (the line saying so is out): only `scontrol requeue`."""
    if not checked:
        can, phrase = can_requeue(job)
        if not can:
            return can, phrase
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, f"cannot requeue SLURM job {job}: no scontrol on this node's PATH"
    # Once the job is requeued Slurm sends SIGTERM to every process of the step, this scontrol among them
    # while it has not exited yet: under load it had not, died of that SIGTERM (exit status -15), and the
    # requeue it had done looked failed (the run recorded "interrupted"). A blocked signal stays blocked
    # through fork and exec (scontrol leaves its signal mask alone): scontrol ends as it would and says how
    # the requeue went; the SIGTERM waits for this thread until the call is over.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        done = subprocess.run(
            [scontrol, "requeue", job], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        return False, f"cannot requeue SLURM job {job}: scontrol did not answer within {_SCONTROL_TIMEOUT:.0f} s"
    except OSError as exc:
        return False, f"cannot requeue SLURM job {job}: scontrol failed to start ({exc.strerror or exc})"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
        return False, f"cannot requeue SLURM job {job}: scontrol requeue: {said[0]}"
    return True, f'requeued SLURM job {job}: it starts again, and resume_from="last" continues from this checkpoint'


# --- the launcher above the ranks: does it survive the signals Slurm sends? ---------------------------
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun catches and passes on to its ranks by default
_TORCHRUN_NAMES = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


@dataclass(frozen=True)
class StepProcess:
    """A process between this one and slurmstepd: the task srun started, or a process under it."""

    pid: int
    name: str
    """"torchrun" for torch's elastic launcher (whose process name is pt_elastic), else the process name."""
    caught: frozenset[int]
    """The signals it has a handler for (SigCgt in /proc/PID/status)."""


def _read_status(proc: str, pid: int) -> dict[str, str] | None:
    try:
        with open(f"{proc}/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return None


def _process_name(proc: str, pid: int, comm: str) -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    # torchrun: `torchrun ...` (a Python script: python .../torchrun), `python -m torch.distributed.run ...`
    if any(os.path.basename(arg) in _TORCHRUN_NAMES for arg in argv[:3]):
        return "torchrun"
    return comm


def step_ancestors(pid: int | None = None, proc: str = "/proc") -> list[StepProcess] | None:
    """The processes between `pid` (this process) and the slurmstepd of its job step, nearest first: [] when
    srun started this process itself. None when the chain of parents does not reach slurmstepd: not in a
    job step, no /proc (not Linux), or a container that hides slurmstepd."""
    chain: list[StepProcess] = []
    current = os.getpid() if pid is None else pid
    for _ in range(64):
        status = _read_status(proc, current)
        if status is None:
            return None
        parent = int(status.get("PPid", "0") or 0)
        if parent <= 1:
            return None
        parent_status = _read_status(proc, parent)
        if parent_status is None:
            return None
        name = parent_status.get("Name", "")
        if name == "slurmstepd":
            return chain
        mask = int(parent_status.get("SigCgt", "0") or "0", 16)
        caught = frozenset(s for s in range(1, 65) if mask >> (s - 1) & 1)
        chain.append(StepProcess(parent, _process_name(proc, parent, name), caught))
        current = parent
    return None


def launcher_hazard(
    signals: Iterable[int], environ: Mapping[str, str] | None = None, proc: str = "/proc", pid: int | None = None
) -> str | None:
    """In a job step srun started: the phrase saying which process above this one (torchrun, a shell) does
    not catch one of `signals` (SIGTERM, the requeue signal), so that the signal from Slurm ends it, and the
    job step with it, before the ranks save; and what to write instead. None when every such process
    catches them (`srun python train.py` has none), outside a job step, or when it cannot be told (see
    `step_ancestors`)."""
    env = os.environ if environ is None else environ
    job = job_id(env)
    if job is None or env.get("SLURM_STEP_ID") is None:
        return None
    ancestors = step_ancestors(pid, proc)
    if not ancestors:
        return None
    wanted = list(dict.fromkeys(signals))  # in the order given
    gaps = [(p, [signal.Signals(s).name for s in wanted if s not in p.caught]) for p in ancestors]
    gaps = [(p, names) for p, names in gaps if names]
    if not gaps:
        return None
    task = ancestors[-1].pid
    who = "; ".join(
        f"{p.name} (pid {p.pid}){', the task srun started,' if p.pid == task else ''} does not handle {' or '.join(n)}"
        for p, n in reversed(gaps)
    )
    missing = [n for n in (signal.Signals(s).name for s in wanted) if any(n in names for _, names in gaps)]
    sent_by = {"SIGTERM": "scancel, a requeue, the time limit"}
    examples = "; ".join(sent_by.get(n, f"--signal={n[3:]}@120, scancel --signal={n[3:]}") for n in missing)
    advice = []
    if any(p.name != "torchrun" for p, _ in gaps):
        advice.append(
            "make the launcher srun's task (srun torchrun ..., srun python train.py; a wrapper script execs it)"
        )
    torchrun_missing = sorted({n for p, names in gaps if p.name == "torchrun" for n in names}, key=missing.index)
    if torchrun_missing:
        handled = [n for n in (env.get("TORCHELASTIC_SIGNALS_TO_HANDLE") or TORCHRUN_SIGNALS).split(",") if n]
        flags = ",".join(handled + [n for n in torchrun_missing if n not in handled])
        advice.append(
            f"write srun torchrun --signals-to-handle={flags} --shutdown-timeout=120 ... (torchrun then passes "
            f"{' and '.join(torchrun_missing)} on to the ranks and waits up to 120 s, the lead --signal gives, for "
            "their checkpoint)"
        )
    return (
        f"SLURM job {job}: {who}: {' and '.join(missing)} from Slurm ({examples}) would end the job step without a "
        f"checkpoint; {'; '.join(advice)}"
    )

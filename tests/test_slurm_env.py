"""SLURM without a Slurm: the ranks `srun` gives, the requeue signal (with a stand-in `scontrol` on
PATH), and the first start of a `resume_from="last"` script. tests/test_slurm.py runs the same against
a real slurmctld/slurmd."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import warnings
from pathlib import Path

import pytest
from conftest import TinyTrainer, quiet_config
from helpers import run_python_forked

from dream_trainer import Callback, TrainingInterrupted
from dream_trainer.utils.slurm import adopt_srun_tasks, first_host, master_port, srun_tasks

STEP = {  # what srun sets for task 1 of `srun --ntasks=4` on two nodes
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
}


def test_srun_tasks_become_torchrun_variables() -> None:
    env = dict(STEP)
    tasks = adopt_srun_tasks(env)
    assert tasks is not None
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu007",
    }
    assert env["MASTER_PORT"] == str(master_port("4242", "0")) and 15000 <= int(env["MASTER_PORT"]) < 32000
    assert srun_tasks(env) is None  # set now: a second trainer reads them as torchrun's


@pytest.mark.parametrize(
    "change",
    [
        {"RANK": "0"},  # srun torchrun ...: torchrun's world
        {"SLURM_STEP_ID": None},  # the batch script's own shell (not a step): one process
        {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},  # srun of one task: nothing to do
    ],
)
def test_srun_tasks_only_in_a_step_of_several_tasks_without_torchrun(change: dict) -> None:
    env = {**STEP, **change}
    env = {k: v for k, v in env.items() if v is not None}
    assert srun_tasks(env) is None


def test_master_address_and_port_set_by_the_user_stay() -> None:
    env = {**STEP, "MASTER_ADDR": "head", "MASTER_PORT": "29400"}
    adopt_srun_tasks(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "29400")


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("localhost", "localhost"),
        ("gpu[003-010,017],cpu1", "gpu003"),
        ("cpu1,gpu[003-010]", "cpu1"),
        ("rack[1-2]-n[01-04]", "rack1-n01"),
        ("node[5,7-9]", "node5"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_the_trainer_takes_its_rank_from_srun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(name, "")  # recorded, so the trainer's own writes are undone after the test
        monkeypatch.delenv(name)
    for name, value in {**STEP, "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}.items():
        monkeypatch.setenv(name, value)
    trainer = TinyTrainer(quiet_config(tmp_path))  # built only: joining the group needs the other ranks
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank) == (3, 4, 1)
    assert os.environ["RANK"] == "3" and os.environ["MASTER_ADDR"] == "gpu007"
    assert "SLURM job" not in capfd.readouterr().err  # rank 0 says it, the others do not


# --- the requeue signal, with a stand-in scontrol ---------------------------------------------------------
class SignalAt(Callback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requeue_flag: int, state: str = "RUNNING") -> Path:
    """`scontrol` that answers `show job` with Requeue=`requeue_flag` and JobState=`state`, and logs its
    arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol-calls"
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        f'if [ "$1" = show ]; then echo "JobId=$3 JobName=train JobState={state} Requeue={requeue_flag}"; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return calls


def _interrupted(tmp_path: Path, **config) -> TrainingInterrupted:
    trainer = TinyTrainer(
        quiet_config(tmp_path / "runs", n_epochs=2, callbacks=[SignalAt(2, signal.SIGUSR1)], **config)
    )
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    return info.value


def test_sigusr1_in_a_slurm_job_saves_and_requeues_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch, requeue_flag=1)
    stop = _interrupted(tmp_path)
    assert stop.code == 128 + signal.SIGUSR1 and stop.checkpoint_path is not None and stop.checkpoint_path.exists()
    assert calls.read_text().splitlines() == ["show job 77", "requeue 77"]
    record = json.loads((tmp_path / "runs" / "version_0" / "run.json").read_text())
    assert record["status"] == "requeued" and record["global_step"] == 2
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "stopped by" in x]
    assert line.startswith("dream_trainer: stopped by SIGUSR1 at global step 2; checkpoint ")
    assert line.endswith(
        'requeued SLURM job 77: it starts again, and resume_from="last" continues from this checkpoint'
    )
    assert record["end_reason"] == line.removeprefix("dream_trainer: ")


def test_a_job_that_cannot_requeue_says_so_in_the_stop_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch, requeue_flag=0)
    stop = _interrupted(tmp_path)
    assert calls.read_text().splitlines() == ["show job 77"]  # never asked to requeue
    assert stop.outcome == "interrupted"
    lines = [x for x in capfd.readouterr().err.splitlines() if "SLURM job" in x]
    assert len(lines) == 1
    assert (
        "; cannot requeue SLURM job 77: it was submitted without --requeue (scontrol show job: Requeue=0)" in lines[0]
    )
    assert lines[0].endswith('resume with fit(ckpt_path="last") (CLI: --ckpt_path last)')
    record = json.loads((tmp_path / "runs" / "version_0" / "run.json").read_text())
    assert record["status"] == "interrupted"


def test_sigterm_saves_but_does_not_requeue_unless_it_is_the_requeue_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch, requeue_flag=1)
    trainer = TinyTrainer(quiet_config(tmp_path / "a", n_epochs=2, callbacks=[SignalAt(2, signal.SIGTERM)]))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.outcome == "interrupted" and not calls.exists()
    config = {"requeue_signal": "SIGTERM"}
    trainer = TinyTrainer(quiet_config(tmp_path / "b", n_epochs=2, callbacks=[SignalAt(2, signal.SIGTERM)], **config))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.outcome == "requeued" and calls.read_text().splitlines()[-1] == "requeue 77"

    # `scancel` sends SIGTERM too: a job no longer RUNNING is being cancelled, and stays cancelled.
    calls = _fake_scontrol(tmp_path, monkeypatch, requeue_flag=1, state="COMPLETING")
    trainer = TinyTrainer(quiet_config(tmp_path / "c", n_epochs=2, callbacks=[SignalAt(2, signal.SIGTERM)], **config))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.outcome == "interrupted" and calls.read_text().splitlines()[-1] == "show job 77"
    assert "cannot requeue SLURM job 77: it is ending (JobState=COMPLETING" in str(info.value.summary(2))


_ENDED_BY_SLURM = """
import os, signal, sys, time
from conftest import TinyTrainer, quiet_config
from test_slurm_env import SignalAt
trainer = TinyTrainer(quiet_config(sys.argv[1], n_epochs=2, callbacks=[SignalAt(2, signal.SIGUSR1)]))
try:
    trainer.fit()
except SystemExit as stop:
    os.kill(os.getpid(), signal.SIGTERM)  # Slurm's SIGTERM once fit() is over: the script goes on
    time.sleep(0.2)
    print("after fit", stop.code)
    raise
"""


def test_slurms_sigterm_after_the_requeue_lets_the_process_end_with_the_stops_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slurm ends a requeued job's processes with SIGTERM (then SIGKILL after KillWait): here the stand-in
    # `scontrol requeue` sends it to the trainer, and to itself before it exits (as Slurm's reached a real
    # scontrol still running, under load: it died of it, and the requeue looked failed), during the rest of
    # fit() (loggers, run.json); the script sends another after fit(). None cuts the exit short or prints a
    # line: the exit code is the stop's, 128 + SIGUSR1, and the run is recorded "requeued". (A Python
    # stand-in: sh unblocks the signals its parent blocked, which scontrol does not.)
    calls = _fake_scontrol(tmp_path, monkeypatch, requeue_flag=1)
    script = tmp_path / "bin" / "scontrol"
    script.write_text(
        f"#!{sys.executable} -S\n"
        "import os, signal, sys, time\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1] == 'show':\n"
        "    print(f'JobId={sys.argv[3]} JobName=train JobState=RUNNING Requeue=1')\n"
        "else:\n"
        "    os.kill(os.getppid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = run_python_forked("-c", _ENDED_BY_SLURM, str(tmp_path / "runs"), timeout=120, env=env)
    assert done.returncode == 128 + signal.SIGUSR1, done.stderr
    assert calls.read_text().splitlines() == ["show job 77", "requeue 77"]
    assert done.stdout.strip() == f"after fit {128 + signal.SIGUSR1}"
    assert "requeued SLURM job 77" in done.stderr and "SIGTERM" not in done.stderr, done.stderr
    record = json.loads((tmp_path / "runs" / "version_0" / "run.json").read_text())
    assert record["status"] == "requeued" and record["global_step"] == 2


# --- the first start of a requeue-ready script -------------------------------------------------------------
def test_resume_from_last_with_nothing_yet_says_so_without_a_warning(tmp_path: Path, monkeypatch, capfd) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, resume_from="last"))
        trainer.fit()
    assert trainer.global_step == 4
    err = capfd.readouterr().err
    assert f'run directory {tmp_path / "version_0"}; resume_from="last": nothing to resume yet in any run under' in err

    # A requeued SLURM job should find the checkpoint its requeue signal wrote: finding none still warns.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.warns(UserWarning, match="no valid checkpoint"):
        TinyTrainer(quiet_config(tmp_path / "requeued", n_epochs=1, resume_from="last")).fit()

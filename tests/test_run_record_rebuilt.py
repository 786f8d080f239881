"""Nothing damaged is trusted, nothing intact is lost: a run whose run.json is gone (or unreadable) but whose
checkpoints are intact is still continued by `fit(ckpt_path="last")`, in its own directory, with a rebuilt
run.json and a warning naming it (never while a live process holds it), and `dream-trainer runs` lists it; a
continued run's temporary files whose writer is gone (a kill -9) are removed, any other kept."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import DreamTrainerError
from dream_trainer.cli.main import main
from dream_trainer.utils.run_dirs import RunLock, read_record
from dream_trainer.utils.stall_dump import pending_name


def fit(root: Path, ckpt_path=None, **config) -> TinyTrainer:
    trainer = TinyTrainer(quiet_config(root, enable_checkpointing=True, **config))
    trainer.fit(ckpt_path=ckpt_path)
    return trainer


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped): nothing runs under it now."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_last_continues_a_run_whose_run_json_was_deleted_and_rebuilds_the_record(tmp_path):
    straight = fit(tmp_path / "straight", n_epochs=2)  # the same training, never stopped
    first = fit(tmp_path / "runs", n_epochs=1)
    run = first.run_dir
    assert run == tmp_path / "runs" / "version_0" and first.global_step == 4
    (run / "run.json").unlink()

    with pytest.warns(UserWarning, match=rf"run '{run}' has checkpoints but its run\.json was missing") as caught:
        resumed = fit(tmp_path / "runs", ckpt_path="last", n_epochs=2)
    (warning,) = [w for w in caught if "run.json was missing" in str(w.message)]
    assert Path(warning.filename).resolve() == Path(__file__).resolve()  # attributed to the user's fit() call
    assert resumed.run_dir == run  # its own directory, not a new version_1
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    assert resumed.global_step == 8 and len(resumed.train_losses) == 4  # epoch 1 only: continued, not redone
    for name, value in straight.model.state_dict().items():  # the weights went on from the checkpoint's
        assert torch.equal(resumed.model.state_dict()[name], value), name

    record = read_record(run)
    assert record["note"] == "rebuilt: run.json was missing" and record["rebuilt"]
    assert record["name"] == "version_0" and record["run_dir"] == str(run.absolute())
    assert record["created"]  # config.yaml's time: when the run was created
    assert record["status"] == "success" and record["global_step"] == 8
    (resume,) = record["resumes"]
    assert Path(resume["checkpoint"]).parent == run / "checkpoints"  # the run's own step-4 checkpoint
    assert resume["outcome"] == "success"


def test_a_run_without_its_record_keeps_its_place_among_the_runs(tmp_path):
    root = tmp_path / "runs"
    fit(root, n_epochs=1)  # version_0
    fit(root, n_epochs=1)  # version_1, whose checkpoint is newer
    os.utime(root / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt", (1e9, 1e9))  # clearly older
    (root / "version_1" / "run.json").unlink()
    # and newest of all, another tool's folder of checkpoints (no config.yaml, no .lock): not a run
    foreign = root / "version_7" / "checkpoints"
    foreign.mkdir(parents=True)
    (foreign / "last.ckpt").write_bytes((root / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt").read_bytes())

    with pytest.warns(UserWarning, match="version_1"):
        resumed = fit(root, ckpt_path="last", n_epochs=2)
    assert resumed.run_dir == root / "version_1" and resumed.global_step == 8
    assert read_record(root / "version_1")["note"] == "rebuilt: run.json was missing"
    assert "note" not in read_record(root / "version_0")  # the older run: untouched
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1", "version_7"]
    assert sorted(p.name for p in (root / "version_7").iterdir()) == ["checkpoints"]


def test_an_unreadable_run_json_is_kept_aside_and_rebuilt(tmp_path):
    run = fit(tmp_path, n_epochs=1).run_dir
    (run / "run.json").write_text('{"name": "version_0", "stat')  # torn

    with pytest.warns(UserWarning, match=rf"run '{run}' has checkpoints but its run\.json was unreadable"):
        resumed = fit(tmp_path, ckpt_path="last", n_epochs=2)
    assert resumed.run_dir == run and resumed.global_step == 8
    assert read_record(run)["note"] == "rebuilt: run.json was unreadable"
    assert (run / "run.json.unreadable").read_text() == '{"name": "version_0", "stat'


def test_a_live_run_without_its_record_is_never_taken_over(tmp_path):
    run = fit(tmp_path, n_epochs=1).run_dir
    (run / "run.json").unlink()
    holder = RunLock(run)
    holder.acquire()  # a live process trains it (flock: another open file conflicts, in this process too)
    try:
        with pytest.raises(DreamTrainerError, match=rf"run '{run}' is in use: pid {os.getpid()}"):
            fit(tmp_path, ckpt_path="last", n_epochs=2)
    finally:
        holder.release()
    assert not (run / "run.json").exists()  # nothing written into the live run
    assert not (tmp_path / "version_1").exists()


def test_runs_lists_a_run_whose_run_json_is_missing(tmp_path, capsys):
    root = tmp_path / "runs"
    fit(root, n_epochs=2, run_name="kept")
    fit(root, n_epochs=1, run_name="lost")
    (root / "lost" / "run.json").unlink()

    assert main(["runs", str(root), "--width", "160"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["kept"].split()[1:4] == ["success", "8", "epoch=1-step=8.ckpt"]
    assert rows["lost"].split()[1:5] == ["no", "run.json", "4+", "epoch=0-step=4.ckpt"]
    assert 'run.json is missing; fit(ckpt_path="last") rebuilds it when it continues this run' in rows["lost"]
    assert not (root / "lost" / "run.json").exists()  # only read


def test_continuing_a_run_removes_the_temporary_files_of_its_dead_processes(tmp_path):
    run = fit(tmp_path, n_epochs=1).run_dir
    host, dead, alive = socket.gethostname(), dead_pid(), os.getppid()  # pytest's parent: it runs
    # what a kill -9 leaves: the hang watchdog's armed (empty) pending file, a run.json being replaced
    gone = [pending_name(0, host, dead), pending_name(3, host, dead), f".run.json.tmp-{dead}"]
    kept = [
        pending_name(1, host, alive),  # its process still runs: it may still write there
        f".run.json.tmp-{alive}",
        pending_name(2, "another-node", dead),  # another host's process cannot be seen from here
    ]
    for name in gone + kept:
        (run / name).write_text("")
    stacks = pending_name(5, host, dead)  # faulthandler wrote a stuck rank's stacks, which nobody collected
    (run / stacks).write_text("Thread 0x1 (most recent call first):\n  File ...\n")
    kept.append(stacks)

    resumed = fit(tmp_path, ckpt_path="last", n_epochs=2)
    assert resumed.run_dir == run and resumed.global_step == 8
    left = {p.name for p in run.iterdir() if p.name.startswith(".")}
    assert not left & set(gone), left
    assert set(kept) <= left, left

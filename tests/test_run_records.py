"""What a person reads after a run, kept right: which checkpoint "last" means, run.json's status after every
entry point and after a kill, partial files of a killed save, a resume that does not fit, the run lock after a
SIGKILL with loader workers alive."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, make_regression_data, quiet_config
from helpers import REPO, ckpt_dir, launcher_free_env, python
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import CheckpointError, ModelCheckpoint
from dream_trainer.callbacks import Profiler
from dream_trainer.utils.checkpoint_io import find_last
from dream_trainer.utils.run_dirs import RunLock, read_record


def fit(root: Path, ckpt_path=None, cls=TinyTrainer, **config) -> TinyTrainer:
    config.setdefault("enable_checkpointing", True)
    trainer = cls(quiet_config(root, **config))
    trainer.fit(ckpt_path=ckpt_path)
    return trainer


def lock_is_free(run_dir: Path) -> bool:
    lock = RunLock(run_dir)
    free = lock.try_acquire()
    lock.release()
    return free


# --- (a) the checkpoint directory is ModelCheckpoint's, found by type ----------------------------------------------
def test_a_profiler_listed_before_model_checkpoint_does_not_hide_the_checkpoints(tmp_path):
    def callbacks():
        return [Profiler(wait=0, warmup=1, active=1, dirpath=tmp_path / "traces"), ModelCheckpoint()]

    first = fit(tmp_path / "runs", n_epochs=1, callbacks=callbacks())
    assert first.checkpoint_dir == first.run_dir / "checkpoints"
    assert (first.run_dir / "checkpoints" / "epoch=0-step=4.ckpt").is_file()
    resumed = fit(tmp_path / "runs", ckpt_path="last", n_epochs=2, callbacks=callbacks())
    assert resumed.run_dir == first.run_dir  # continued, not a new run from scratch
    assert resumed.global_step == 8 and len(resumed.train_losses) == 4


# --- (c) "last" is the newest valid checkpoint, whatever last.ckpt names ---------------------------------------------
def test_last_takes_a_checkpoint_newer_than_the_one_last_ckpt_names(tmp_path):
    fit(tmp_path, n_epochs=2, callbacks=[ModelCheckpoint(every_n_train_steps=4, save_last=True, save_top_k=-1)])
    d = ckpt_dir(tmp_path)
    # as if killed after writing the step-8 file and before moving last.ckpt to it: last.ckpt names step 4
    os.link(d / "epoch=0-step=4.ckpt", d / "tmp")
    os.replace(d / "tmp", d / "last.ckpt")
    path, state = find_last(d)
    assert path == d / "epoch=1-step=8.ckpt" and state["counters"]["global_step"] == 8
    resumed = fit(tmp_path, ckpt_path="last", n_epochs=3)
    assert resumed.global_step == 12 and len(resumed.train_losses) == 4  # epoch 2 only: nothing trained twice


# --- (b), (h): runs SIGKILLed in their first save, and with loader workers alive ---------------------------------
# One interpreter (torch's import is most of its time) runs both: a forked child is killed inside its first
# save (the temporary file complete, not yet renamed); then the process itself trains with two persistent
# loader workers and is killed at step 3, its workers still alive.
KILLED_RUNS = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from torch.utils.data import DataLoader, TensorDataset
    import dream_trainer.utils.checkpoint_io as io
    from conftest import TinyTrainer, make_regression_data, quiet_config
    from dream_trainer import Callback, ModelCheckpoint

    def die(new, path):
        os.kill(os.getpid(), signal.SIGKILL)

    child = os.fork()
    if child == 0:
        io._replace = die
        cb = ModelCheckpoint(every_n_train_steps=2)
        TinyTrainer(quiet_config({in_save!r}, n_epochs=1, enable_checkpointing=True, callbacks=[cb])).fit()
        os._exit(3)
    os.waitpid(child, 0)

    class Workers(TinyTrainer):
        def configure_dataloaders(self):
            x, y = make_regression_data(64)
            return DataLoader(TensorDataset(x, y), batch_size=4, num_workers=2, persistent_workers=True), None

    class Kill(Callback):
        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    cb = ModelCheckpoint(every_n_train_steps=2)
    Workers(quiet_config({workers!r}, n_epochs=1, enable_checkpointing=True, callbacks=[cb, Kill()])).fit()
    """
)


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("killed")
    script = tmp / "killed.py"
    roots = {"in_save": tmp / "in_save", "workers": tmp / "workers"}
    script.write_text(KILLED_RUNS.format(tests=str(REPO / "tests"), **{k: str(v) for k, v in roots.items()}))
    with open(tmp / "out.txt", "wb") as out:  # not a pipe: the orphaned workers keep theirs open
        proc = subprocess.Popen([python(), str(script)], env=launcher_free_env(), stdout=out, stderr=out)
        code = proc.wait(timeout=180)
    # at once, while the dead run's loader workers are still alive (they notice in ~5 s)
    free_at_once = lock_is_free(roots["workers"] / "version_0")
    return {**roots, "code": code, "free_at_once": free_at_once, "out": (tmp / "out.txt").read_text()[-3000:]}


@pytest.mark.slow
def test_the_next_run_marks_a_run_killed_in_its_first_save_and_removes_its_partial_file(killed_runs, capsys):
    root = killed_runs["in_save"]
    dead = root / "version_0"
    assert read_record(dead)["status"] == "running", killed_runs["out"]
    assert [p for p in os.listdir(dead / "checkpoints") if ".tmp-" in p]  # the partial file the kill left

    busy = root / "version_1"  # a run whose process is alive: never touched
    busy.mkdir()
    (busy / "run.json").write_text('{"status": "running"}')
    held = RunLock(busy)
    held.acquire()
    try:
        fit(root, n_epochs=1)
    finally:
        held.release()
    assert read_record(dead)["status"] == "killed"
    assert os.listdir(dead / "checkpoints") == []  # nothing partial left
    assert read_record(busy)["status"] == "running"
    assert read_record(root / "version_2")["status"] == "success"
    assert "version_0" in capsys.readouterr().err


class Workers(TinyTrainer):  # the killed script's trainer, here without loader workers
    def configure_dataloaders(self):
        x, y = make_regression_data(64)
        return DataLoader(TensorDataset(x, y), batch_size=4), None


@pytest.mark.slow
def test_a_run_killed_with_loader_workers_alive_resumes_at_once(killed_runs):
    assert killed_runs["code"] == -signal.SIGKILL, killed_runs["out"]
    assert killed_runs["free_at_once"]  # the workers, still alive, do not hold the run's lock
    resumed = fit(killed_runs["workers"], ckpt_path="last", n_epochs=1, cls=Workers)
    assert resumed.run_dir == killed_runs["workers"] / "version_0"
    assert resumed.global_step == 16 and len(resumed.train_losses) == 14  # continued from step 2
    assert read_record(resumed.run_dir)["status"] == "success"


# --- (d) a resume that does not fit: the finished run stays "success", a short first line ---------------------------
class Hidden(TinyTrainer):
    hidden = 8

    def __init__(self, config):
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, self.hidden), nn.Linear(self.hidden, 1))


class Wider(Hidden):
    hidden = 16


def test_a_resume_with_another_model_size_keeps_the_finished_run_and_says_what_does_not_fit(tmp_path):
    run = fit(tmp_path, n_epochs=1, cls=Hidden).run_dir
    assert read_record(run)["status"] == "success"
    Wider.__qualname__ = Hidden.__qualname__  # the same trainer, another size: only the weights differ
    with pytest.raises(CheckpointError) as info:
        fit(tmp_path, ckpt_path="last", n_epochs=2, cls=Wider)
    first, *below = str(info.value).splitlines()
    assert len(first) < 300, first
    assert "'model'" in first and "another shape" in first and "start a new run" in first
    assert any("0.weight: [8, 4] in the checkpoint, [16, 4] here" in line for line in below)
    record = read_record(run)
    assert record["status"] == "success"  # the finished run is still finished
    assert record["resumes"][-1]["outcome"] == "failed"
    assert lock_is_free(run)


def test_a_missing_entry_suggests_strict_false(tmp_path):
    class Renamed(Hidden):
        def __init__(self, config):
            super().__init__(config)
            self.model.add_module("2", nn.Identity())
            self.model.register_buffer("extra", torch.zeros(1))

    Renamed.__qualname__ = Hidden.__qualname__
    fit(tmp_path, n_epochs=1, cls=Hidden)
    with pytest.raises(CheckpointError) as info:
        fit(tmp_path, ckpt_path="last", n_epochs=2, cls=Renamed)
    first, *below = str(info.value).splitlines()
    assert "1 missing from the checkpoint" in first and "strict=False" in first and len(first) < 300
    assert below == ["  missing from the checkpoint: extra"]


# --- (e) every entry point leaves a final status and names its checkpoint -------------------------------------------
def test_validate_leaves_a_final_status_naming_its_checkpoint(tmp_path):
    trained = fit(tmp_path, n_epochs=1)
    path = trained.run_dir / "checkpoints" / "last.ckpt"
    evaluator = TinyTrainer(quiet_config(tmp_path))
    evaluator.validate(ckpt_path=path)
    record = read_record(evaluator.run_dir)
    assert evaluator.run_dir == tmp_path / "version_1"
    assert record["status"] == "success"
    assert [(e["entry"], e["checkpoint"], e["outcome"]) for e in record["evaluations"]] == [
        ("validate", str(path), "success")
    ]
    assert lock_is_free(evaluator.run_dir)

    evaluator.validate(ckpt_path="last")  # again, on the same run: another entry, "last" named as the file it read
    record = read_record(evaluator.run_dir)
    assert [e["checkpoint"] for e in record["evaluations"]] == [str(path), str(path)]

    trained.validate()  # after fit, on fit's run: an entry, the run's status untouched
    record = read_record(trained.run_dir)
    assert record["status"] == "success" and record["evaluations"][0]["checkpoint"] is None


def test_a_failing_validate_records_failed(tmp_path):
    class Broken(TinyTrainer):
        def validation_step(self, batch, batch_idx):
            raise RuntimeError("broken metric")

    trainer = Broken(quiet_config(tmp_path))
    with pytest.raises(RuntimeError, match="broken metric"):
        trainer.validate()
    assert read_record(trainer.run_dir)["status"] == "failed"
    assert lock_is_free(trainer.run_dir)

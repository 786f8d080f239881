"""Run isolation: every run owns a directory that no later run writes into or deletes from; resuming
is explicit (`fit(ckpt_path="last")` continues the newest run, in its own directory, whatever strategy
wrote it); two processes started at once never share a run directory.

Each test here would have failed on the layout where every run of a `root_dir` shared
`<root_dir>/checkpoints` (the second run overwrote `epoch=0-step=8.ckpt` and `last.ckpt` of the first,
its rotation deleted them, and a strategy change crashed at the first save).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import REPO, ckpt_dir, launcher_free_env, python

from dream_trainer import DreamTrainerError, ModelCheckpoint
from dream_trainer.errors import ConfigError
from dream_trainer.utils.checkpoint_io import read_checkpoint
from dream_trainer.utils.run_dirs import RunLock, claim_run_dir, read_record


def digests(directory: Path) -> dict[str, str]:
    """Name -> sha256 of every file under `directory` (what a later run must leave untouched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


class MomentumTiny(TinyTrainer):
    """With optimizer state: a stateless SGD's empty state does not load into FSDP through torch's
    full-state-dict path ("Expected device to be set"), a limitation unrelated to run directories."""

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)


def fit(root: Path, ckpt_path: str | Path | None = None, lr: float = 0.1, cls=TinyTrainer, **config) -> TinyTrainer:
    config.setdefault("enable_checkpointing", True)
    trainer = cls(quiet_config(root, **config), lr=lr)
    trainer.fit(ckpt_path=ckpt_path)
    return trainer


# --- a second run never touches the first ---------------------------------------------------------------
def test_a_second_run_with_another_hyperparameter_overwrites_nothing(tmp_path, capsys):
    first = fit(tmp_path, n_epochs=2, lr=0.1)
    assert first.run_dir == tmp_path / "version_0"
    before = digests(first.run_dir)
    assert {"run.json", "config.yaml", "checkpoints/epoch=1-step=8.ckpt", "checkpoints/last.ckpt"} <= set(before)

    second = fit(tmp_path, n_epochs=2, lr=0.05)  # same script, same directory, another learning rate
    assert second.run_dir == tmp_path / "version_1"
    assert digests(first.run_dir) == before  # not one byte of the first run changed
    assert read_record(first.run_dir)["status"] == "success"
    first_w = read_checkpoint(first.run_dir / "checkpoints" / "last.ckpt")["models"]["model"]["weight"]
    second_w = read_checkpoint(second.run_dir / "checkpoints" / "last.ckpt")["models"]["model"]["weight"]
    assert not torch.equal(first_w, second_w)
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'version_0'}" in err and f"run directory {tmp_path / 'version_1'}" in err


def test_rotation_never_deletes_files_of_another_run(tmp_path):
    # Run A keeps every step; run B starts from one of A's files (explicit path: a new run) and keeps
    # only its newest file. B's rotation must not touch A's files, though B's callback state, loaded
    # from A's checkpoint, lists them.
    keep_all = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True)
    a = fit(tmp_path, n_epochs=1, callbacks=[keep_all])
    before = digests(a.run_dir)
    keep_one = ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True)
    b = fit(tmp_path, ckpt_path=ckpt_dir(tmp_path) / "epoch=0-step=2.ckpt", n_epochs=2, callbacks=[keep_one])
    assert b.run_dir == tmp_path / "version_1" and b.global_step == 8
    assert digests(a.run_dir) == before
    assert sorted(p.name for p in (b.run_dir / "checkpoints").iterdir()) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert read_record(b.run_dir)["started_from"] == str(ckpt_dir(tmp_path) / "epoch=0-step=2.ckpt")


def test_a_shared_dirpath_gets_versioned_names_instead_of_overwriting(tmp_path):
    shared = tmp_path / "shared"
    fit(tmp_path, n_epochs=1, callbacks=[ModelCheckpoint(dirpath=shared, every_n_train_steps=2, save_top_k=-1)])
    first = digests(shared)
    assert sorted(first) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    cb = ModelCheckpoint(dirpath=shared, every_n_train_steps=2, save_top_k=1)
    fit(tmp_path, n_epochs=1, lr=0.05, callbacks=[cb])
    after = digests(shared)
    assert {k: after[k] for k in first} == first  # the first run's files are intact
    assert sorted(set(after) - set(first)) == ["epoch=0-step=4-v1.ckpt"]  # step 2's -v1 was rotated away


# --- "last" continues the newest run, in place -------------------------------------------------------------
def test_last_continues_the_newest_run_in_its_own_directory(tmp_path, capsys):
    fit(tmp_path, n_epochs=1)
    newest = fit(tmp_path, n_epochs=1, lr=0.05)
    resumed = TinyTrainer(quiet_config(tmp_path, n_epochs=2, enable_checkpointing=True), lr=0.05)
    resumed.fit(ckpt_path="last")
    assert resumed.run_dir == newest.run_dir == tmp_path / "version_1"
    assert resumed.global_step == 8 and len(resumed.train_losses) == 4  # only the second epoch ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0", "version_1"]  # no new run
    record = read_record(newest.run_dir)
    assert [r["checkpoint"] for r in record["resumes"]] == [str(ckpt_dir(tmp_path, "version_1") / "last.ckpt")]
    assert "continuing run" in capsys.readouterr().err


def test_last_skips_runs_without_a_checkpoint(tmp_path):
    fit(tmp_path, n_epochs=1)
    fit(tmp_path, n_epochs=1, enable_checkpointing=False)  # version_1: newer, but nothing to resume from
    resumed = fit(tmp_path, ckpt_path="last", n_epochs=2)
    assert resumed.run_dir == tmp_path / "version_0" and resumed.global_step == 8


def test_a_named_run_resumes_by_name(tmp_path):
    fit(tmp_path, n_epochs=1, run_name="a")
    fit(tmp_path, n_epochs=1, run_name="b")  # newer, but not "a"
    resumed = fit(tmp_path, ckpt_path="last", n_epochs=2, run_name="a")
    assert resumed.run_dir == tmp_path / "a" and resumed.global_step == 8

    again = fit(tmp_path, n_epochs=1, run_name="a")  # a new run named "a": the name is taken
    assert again.run_dir == tmp_path / "a-v1"
    resumed = fit(tmp_path, ckpt_path="last", n_epochs=2, run_name="a")  # the newest of "a", "a-v1"
    assert resumed.run_dir == tmp_path / "a-v1" and resumed.global_step == 8


def test_resume_from_config_starts_then_continues_one_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a first start of a resume_from="last" script is expected: no warning
        first = fit(tmp_path, n_epochs=1, resume_from="last")
    second = fit(tmp_path, n_epochs=2, resume_from="last")
    assert first.run_dir == second.run_dir == tmp_path / "version_0"
    assert second.global_step == 8 and len(second.train_losses) == 4


def test_a_run_in_use_is_never_continued(tmp_path):
    fit(tmp_path, n_epochs=1)
    lock = RunLock(tmp_path / "version_0")
    lock.acquire()  # as the process training it would
    try:
        with pytest.raises(DreamTrainerError, match=r"is in use: pid \d+ on .* holds its lock"):
            fit(tmp_path, ckpt_path="last", n_epochs=2)
    finally:
        lock.release()
    assert fit(tmp_path, ckpt_path="last", n_epochs=2).global_step == 8  # free again


def test_run_dir_read_before_fit(tmp_path):
    fit(tmp_path, n_epochs=1)
    fresh = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    assert fresh.run_dir == tmp_path / "version_1" and fresh.run_dir.is_dir()  # claimed when read
    fresh.fit()
    assert fresh.run_dir == tmp_path / "version_1"  # and that is the run fit() trains

    resuming = TinyTrainer(quiet_config(tmp_path, n_epochs=2, enable_checkpointing=True))
    early = resuming.run_dir  # version_2, claimed but never used ...
    resuming.fit(ckpt_path="last")  # ... given back: "last" continues version_0, the newest with a checkpoint
    assert resuming.run_dir == tmp_path / "version_0" and resuming.global_step == 8
    assert early == tmp_path / "version_2" and not early.exists()


def test_the_old_layout_still_resumes_into_a_new_run_directory(tmp_path):
    # What earlier versions wrote: <root_dir>/checkpoints/last.ckpt, no run directory, no run record.
    old = TinyTrainer(quiet_config(tmp_path / "elsewhere", n_epochs=1))
    old.fit()
    state = old.state_dict()
    del state["dream_trainer"]["run_dir"]
    legacy = tmp_path / "checkpoints"
    legacy.mkdir()
    torch.save(state, legacy / "last.ckpt")
    before = digests(legacy)

    resumed = fit(tmp_path, ckpt_path="last", n_epochs=2)
    assert resumed.global_step == 8 and len(resumed.train_losses) == 4
    assert resumed.run_dir == tmp_path / "version_0"
    assert digests(legacy) == before  # read, never written
    assert read_record(resumed.run_dir)["started_from"] == str(legacy / "last.ckpt")


def test_run_name_cannot_take_the_old_layout_names():
    for name in ("checkpoints", "logs"):
        with pytest.raises(ConfigError, match="earlier versions"):
            quiet_config(run_name=name)
    for name in ("a/b", ".hidden", ""):
        with pytest.raises(ConfigError, match="run_name"):
            quiet_config(run_name=name)


def test_the_cli_ckpt_path_last_continues_the_newest_run(tmp_path):
    from test_cli import TARGET, YAML, small

    from dream_trainer.cli import run

    first = run(["fit", TARGET, "--config", str(YAML), "--n_epochs", "1", *small(tmp_path)]).trainer
    resumed = run(["fit", TARGET, "--config", str(YAML), "--n_epochs", "2", "--ckpt_path", "last", *small(tmp_path)])
    assert resumed.trainer.run_dir == first.run_dir == tmp_path / "version_0"
    assert resumed.trainer.global_step == 2 * first.global_step


# --- whatever strategy wrote it ----------------------------------------------------------------------------
@pytest.mark.slow  # FSDP on one process: a process group and DCP, ~10 s
def test_strategy_changes_between_runs_and_across_a_resume(tmp_path):
    # Two fresh runs, one process then FSDP: each writes its own directory (no NotADirectoryError).
    plain = fit(tmp_path, n_epochs=1)
    sharded = fit(tmp_path, n_epochs=1, strategy="fsdp")
    assert (plain.run_dir.name, sharded.run_dir.name) == ("version_0", "version_1")
    assert (ckpt_dir(tmp_path, "version_0") / "last.ckpt").is_file()
    assert (ckpt_dir(tmp_path, "version_1") / "last.ckpt").is_dir()

    # A fixed file name, so the continued runs write over the same name under the other strategy.
    def fixed():
        return [ModelCheckpoint(filename="fixed", save_last=True)]

    d = ckpt_dir(tmp_path, "version_2")
    fit(tmp_path, n_epochs=1, cls=MomentumTiny, callbacks=fixed())  # version_2: fixed.ckpt, a file
    assert (d / "fixed.ckpt").is_file()
    fsdp = fit(tmp_path, ckpt_path="last", n_epochs=2, cls=MomentumTiny, strategy="fsdp", callbacks=fixed())
    assert fsdp.run_dir == tmp_path / "version_2" and fsdp.global_step == 8
    assert (d / "fixed.ckpt").is_dir() and (d / "last.ckpt").is_symlink()  # the file made way
    back = fit(tmp_path, ckpt_path="last", n_epochs=3, cls=MomentumTiny, callbacks=fixed())  # and back to a file
    assert back.run_dir == tmp_path / "version_2" and back.global_step == 12
    assert (d / "fixed.ckpt").is_file() and os.path.samefile(d / "last.ckpt", d / "fixed.ckpt")
    assert sorted(p.name for p in d.iterdir()) == ["fixed.ckpt", "last.ckpt"]  # nothing left over


# --- two processes at once -----------------------------------------------------------------------------------
def _claim_after(barrier, root: str, name: str | None, out) -> None:
    barrier.wait()
    out.put(str(claim_run_dir(Path(root), name)))


@pytest.mark.parametrize("name", [None, "exp"])
def test_processes_started_at_once_never_share_a_run_directory(tmp_path, name):
    ctx = multiprocessing.get_context("fork")
    n = 8
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_claim_after, args=(barrier, str(tmp_path), name, out)) for _ in range(n)]
    for p in procs:
        p.start()
    claimed = sorted(out.get(timeout=60) for _ in range(n))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(set(claimed)) == n, claimed
    expected = [f"version_{i}" for i in range(n)] if name is None else ["exp", *(f"exp-v{i}" for i in range(1, n))]
    assert sorted(Path(c).name for c in claimed) == sorted(expected)


@pytest.mark.slow  # two fresh interpreters (torch imports), started together
def test_two_fits_started_together_get_two_run_directories(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path[:0] = [{str(REPO / "tests")!r}, {str(REPO)!r}]
        from conftest import TinyTrainer, quiet_config
        start = float(sys.argv[1])
        time.sleep(max(0.0, start - time.time()))  # both claim at the same moment
        trainer = TinyTrainer(quiet_config({str(tmp_path)!r}, n_epochs=1, enable_checkpointing=True))
        trainer.fit()
        print("RUN", trainer.run_dir)
        """
    )
    import time

    start = str(time.time() + 8)
    procs = [
        subprocess.Popen([python(), "-c", script, start], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=launcher_free_env())
        for _ in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = sorted(line.split()[1] for out, _ in outs for line in out.splitlines() if line.startswith("RUN"))
    assert runs == [str(tmp_path / "version_0"), str(tmp_path / "version_1")]
    for run in runs:
        record = json.loads((Path(run) / "run.json").read_text())
        assert record["status"] == "success" and (Path(run) / "checkpoints" / "last.ckpt").is_file()

"""`dream-trainer runs [ROOT]`: every run under a root, with its status, last step, newest checkpoint and
how it ended, from run.json, in 80 columns."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from conftest import TinyTrainer, quiet_config

from dream_trainer import Callback, ModelCheckpoint
from dream_trainer.cli.main import main
from dream_trainer.utils.run_dirs import RunLock


class At(Callback):
    def __init__(self, step: int, act) -> None:
        self.step, self.act = step, act

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.act()


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _oom() -> None:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(the allocator's details)")


def _fit(root: Path, name: str, *callbacks: Callback) -> None:
    config = quiet_config(root, n_epochs=2, run_name=name, callbacks=[ModelCheckpoint(), *callbacks])
    TinyTrainer(config).fit()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Five runs: one of each way a run ends, and one still running."""
    root = tmp_path / "runs"
    _fit(root, "a-finished")
    with pytest.raises(SystemExit):
        _fit(root, "b-interrupted", At(3, _sigterm))
    with pytest.raises(RuntimeError):
        _fit(root, "c-failed-with-a-rather-long-experiment-name-lr3e-4", At(6, _oom))
    for name, pid in (("d-killed", 999_999), ("e-running", os.getpid())):
        run = root / name
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "epoch=0-step=7.ckpt").write_bytes(b"")
        record = {"name": name, "created": f"2999-01-0{len(name)}T00:00:00+00:00", "pid": pid, "host": "node3"}
        (run / "run.json").write_text(json.dumps({**record, "status": "running", "resumes": []}))
    return root


def _listing(capsys, *argv: str) -> list[str]:
    assert main(["runs", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_runs_lists_each_run_with_its_status_step_checkpoint_and_how_it_ended(root: Path, capsys) -> None:
    holder = RunLock(root / "e-running")
    holder.acquire()  # a live process trains it
    try:
        lines = _listing(capsys, str(root))
    finally:
        holder.release()
    assert lines[0].split() == ["NAME", "STATUS", "STEP", "CHECKPOINT"]
    rows = [line.split()[:4] for line in lines[1:] if not line.startswith(" ")]
    assert rows == [
        ["a-finished", "success", "8", "epoch=1-step=8.ckpt"],
        ["b-interrupted", "interrupted", "3", "signal-epoch=0-step=3.ckpt"],
        ["c-failed-with-a…ment-name-lr3e-4", "failed", "6", "epoch=0-step=4.ckpt"],
        ["d-killed", "killed", "7+", "epoch=0-step=7.ckpt"],
        ["e-running", "running", "7+", "epoch=0-step=7.ckpt"],
    ]
    text = " ".join(" ".join(line.split()) for line in lines)
    assert "finished at global step 8" in text
    assert (
        "stopped by SIGTERM at global step 3; checkpoint checkpoints/signal-epoch=0-step=3.ckpt; "
        'resume with fit(ckpt_path="last")' in text
    )
    assert "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (global step 6)" in text
    assert "died without recording how (pid 999999 on node3)" in text
    assert f"running: pid {os.getpid()} on " in text
    assert max(len(line) for line in lines) <= 80
    assert json.loads((root / "d-killed" / "run.json").read_text())["status"] == "running"  # only read


def test_runs_puts_how_it_ended_beside_the_row_when_wide_enough(root: Path, capsys) -> None:
    lines = _listing(capsys, str(root), "--width", "160")
    assert lines[0].split() == ["NAME", "STATUS", "STEP", "CHECKPOINT", "HOW", "IT", "ENDED"]
    (finished,) = [line for line in lines if line.startswith("a-finished")]
    assert finished.split()[-5:] == ["finished", "at", "global", "step", "8"]
    assert max(len(line) for line in lines) <= 160


def test_runs_of_the_default_root_and_of_an_empty_one(tmp_path: Path, capsys) -> None:
    (tmp_path / "runs").mkdir()  # the tests run in tmp_path: "runs" is ./runs
    assert _listing(capsys) == ["no runs under 'runs' (a run is a directory holding run.json)"]


def test_runs_of_a_missing_root_is_one_line_and_status_2(tmp_path: Path, capsys) -> None:
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"dream-trainer runs: error: {str(tmp_path / 'nowhere')!r} is not a directory; give the root_dir of "
        "your runs: dream-trainer runs PATH"
    ]

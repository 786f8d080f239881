"""A run stopped after its checkpoint at step 8 (at step 10: by an exception, or SIGKILLed) and
resumed with `fit(ckpt_path="last")` to step 16: metrics.csv, metrics.jsonl and TensorBoard hold
every step, and every metric at it, once, with the values of the same run never interrupted.

The step-8 checkpoint is written at the end of epoch 0's last batch, before that epoch's validation
and means: the resumed run logs those again at step 8, while `loss` at step 8 (logged before the
checkpoint) is not logged again."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import pytest
from conftest import TinyTrainer, quiet_config
from helpers import csv_series, jsonl_series, run_python_forked

from dream_trainer import Callback
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.loggers import CSVLogger, JSONLinesLogger, TensorBoardLogger

STOP_AT = 10
TESTS = Path(__file__).resolve().parent


class Stop(Callback):
    """Ends the process after step `STOP_AT` was logged: an exception, or SIGKILL."""

    def __init__(self, kill: bool) -> None:
        self.kill, self.armed = kill, True

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == STOP_AT and self.armed:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            self.armed = False  # once: a second fit() of the same trainer goes on
            raise RuntimeError("stopped")


def run(root: Path, stop: str | None = None, ckpt_path: str | None = None, again: bool = False) -> Path:
    """Two epochs of 8 steps, every step logged, a checkpoint every 4 steps; returns the run directory.
    `again`: after the stop, the same trainer object continues with `fit(ckpt_path="last")`."""
    callbacks: list[Callback] = [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)]
    if stop is not None:
        callbacks.append(Stop(kill=stop == "kill"))
    loggers = [CSVLogger(flush_every=1 if not again else 100), JSONLinesLogger(), TensorBoardLogger(flush_secs=0)]
    config = quiet_config(root, n_epochs=2, log_every_n_steps=1, callbacks=callbacks, loggers=loggers)
    trainer = TinyTrainer(config, n_train=32, n_val=8)
    try:
        trainer.fit(ckpt_path=ckpt_path)
    except RuntimeError as exc:
        assert str(exc) == "stopped"
    if again:
        trainer.fit(ckpt_path="last")
    return trainer.run_dir


def tensorboard_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


READERS = {"csv": csv_series, "jsonl": jsonl_series, "tensorboard": tensorboard_series}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[tuple[int, float]]]]:
    run_dir = run(tmp_path_factory.mktemp("full"))
    return {name: read(run_dir) for name, read in READERS.items()}


def _check(run_dir: Path, expected: dict[str, dict[str, list[tuple[int, float]]]]) -> None:
    for name, read in READERS.items():
        got = read(run_dir)
        assert sorted(got) == sorted(expected[name]), name
        for key, points in expected[name].items():
            assert [s for s, _ in got[key]] == [s for s, _ in points], (name, key)  # each step once, in order
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in points], rel=1e-6), (name, key)
    assert [s for s, _ in expected["csv"]["loss"]] == list(range(1, 17))
    assert [s for s, _ in expected["csv"]["val_loss"]] == [8, 16]


def test_a_run_stopped_by_an_exception_and_resumed_keeps_every_step_once(tmp_path, uninterrupted):
    first = run(tmp_path, stop="exception")
    stale = csv_series(first)
    assert max(s for s, _ in stale["loss"]) == STOP_AT  # steps 9-10 were written after the step-8 checkpoint
    resumed = run(tmp_path, ckpt_path="last")
    assert resumed == first
    _check(resumed, uninterrupted)


def test_a_second_fit_of_the_same_trainer_keeps_every_step_once(tmp_path, uninterrupted):
    # The loggers are attached already (and CSVLogger still holds rows in memory): they go back to the
    # checkpoint's step as a new process's would.
    _check(run(tmp_path, stop="exception", again=True), uninterrupted)


def test_a_killed_run_resumed_keeps_every_step_once(tmp_path, uninterrupted):
    module, root = Path(__file__).stem, str(tmp_path)
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import {module} as m; m.run(m.Path({root!r}), 'kill')"
    proc = run_python_forked("-c", code, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (first,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert max(s for s, _ in jsonl_series(first)["loss"]) == STOP_AT
    resumed = run(tmp_path, ckpt_path="last")
    assert resumed == first
    _check(resumed, uninterrupted)


def test_a_new_run_in_the_same_save_dir_keeps_the_other_runs_rows(tmp_path):
    shared = tmp_path / "shared"
    for name in ("a", "b"):
        config = quiet_config(tmp_path / name, n_epochs=1, log_every_n_steps=1, loggers=[CSVLogger(save_dir=shared)])
        if name == "b":
            with pytest.warns(UserWarning, match="already holds 6 rows of another run") as caught:
                TinyTrainer(config).fit()
            assert caught[0].filename == __file__
        else:
            TinyTrainer(config).fit()
    with open(shared / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == [1, 2, 3, 4, 4, 4, 1, 2, 3, 4, 4, 4]

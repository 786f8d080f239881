"""MLFlowLogger and WandbLogger across a resume: a run stopped after its checkpoint at step 8 (at step
10: by an exception, or SIGKILLed) and resumed with `fit(ckpt_path="last")` to step 16 continues the
same MLflow run and the same W&B run, which then hold every step, and every metric at it, once, with the
values of the same run never interrupted.

MLflow is a real tracking server on 127.0.0.1 (`test_logger_mlflow`'s fixture), read back with
`MlflowClient`; W&B runs offline and its `.wandb` files (one per process) are read back with
`test_logger_wandb`'s reader, in the order `wandb sync` uploads them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_logger_mlflow
import test_logger_wandb
from conftest import TinyTrainer, quiet_config
from helpers import python
from test_logger_wandb import OfflineRun

from dream_trainer import Callback, MemoryLogger
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.loggers import MLFlowLogger, WandbLogger
from dream_trainer.loggers.wandb import STEP_METRIC

# mlflow and wandb are imported by the tests (test_logger_mlflow.py says why)
pytestmark = [
    test_logger_mlflow.needs_mlflow,
    test_logger_wandb.needs_wandb,
    pytest.mark.slow,  # an MLflow server per module, W&B's service per run
]

server = test_logger_mlflow.server  # a tracking server on 127.0.0.1 (one for this module)
offline = test_logger_wandb.offline  # W&B offline, its files in the test's directory, no network

STOP_AT = 10
TESTS = Path(__file__).resolve().parent
History = list[tuple[int, dict[str, float]]]


class Stop(Callback):
    """Ends the run after step `STOP_AT` was logged, once: `"exception"`, `"kill"` (SIGKILL) or None (never;
    the resumed run has it too, so that its config is the same)."""

    def __init__(self, how: str | None) -> None:
        self.how = how

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == STOP_AT and self.how is not None:
            how, self.how = self.how, None
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("stopped")


def make_trainer(root: Path, uri: str | None, stop: str | None = None) -> TinyTrainer:
    """Two epochs of 8 steps, every step logged, a checkpoint every 4 steps, to MLflow, W&B and memory."""
    callbacks: list[Callback] = [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1), Stop(stop)]
    loggers: list[Any] = [MemoryLogger()]
    if uri is not None:
        loggers += [
            MLFlowLogger(experiment_name="resume", tracking_uri=uri, flush_secs=0.1, log_checkpoints=False),
            WandbLogger(project="resume", flush_secs=0.1, log_checkpoints=False),
        ]
    config = quiet_config(root, n_epochs=2, log_every_n_steps=1, callbacks=callbacks, loggers=loggers)
    return TinyTrainer(config, n_train=32, n_val=8)


def fit(trainer: TinyTrainer, ckpt_path: str | None = None) -> None:
    try:
        trainer.fit(ckpt_path=ckpt_path)
    except RuntimeError as exc:
        assert str(exc) == "stopped"


def run(root: Path, uri: str | None, stop: str | None = None, ckpt_path: str | None = None) -> TinyTrainer:
    trainer = make_trainer(root, uri, stop)
    fit(trainer, ckpt_path)
    return trainer


def mlflow_history(uri: str, run_dir: Path) -> tuple[Any, dict[str, list[tuple[int, float]]]]:
    """The one MLflow run of `run_dir`, and each metric's values in the order of their steps."""
    client = test_logger_mlflow.mlflow_client(uri)
    experiment = client.get_experiment_by_name("resume")
    (mlflow_run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`dream_trainer.run_dir` = '{run_dir}'"
    )
    run_id = mlflow_run.info.run_id
    series = {}
    for name in mlflow_run.data.metrics:
        history = sorted(client.get_metric_history(run_id, name), key=lambda m: (m.step, m.timestamp))
        series[name] = [(m.step, m.value) for m in history]
    return mlflow_run, series


def wandb_history(run_dir: Path) -> tuple[set[str], History]:
    """The W&B run ids of `run_dir`'s `.wandb` files, and their history rows, file after file."""
    import wandb

    wandb.teardown()  # the service writes the files' last records on its own time: stopping it completes them
    paths = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    rows = [row for path in paths for row in OfflineRun(path).history]
    # the id from the file's name: a second start in the same second gets a directory with a "-1" suffix
    ids = {path.stem.removeprefix("run-") for path in paths}
    return ids, [(row[STEP_METRIC], {k: v for k, v in row.items() if k[0] != "_" and k != STEP_METRIC}) for row in rows]


def series_of(history: History) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in history:
        for name, value in metrics.items():
            series.setdefault(name, []).append((step, value))
    return series


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> History:
    memory = run(tmp_path_factory.mktemp("full"), None).loggers[0]
    assert isinstance(memory, MemoryLogger)
    steps = [s for s, _ in memory.series("loss")]
    assert steps == list(range(1, 17)) and [s for s, _ in memory.series("val_loss")] == [8, 16]
    return memory.history


def check(uri: str, run_dir: Path, expected: History, resumed_at: str | None = "8") -> None:
    """The MLflow run and the W&B run of `run_dir` hold `expected`, each step of each metric once;
    `resumed_at`: the MLflow run's `dream_trainer.resumed_at_step` tag ("any": not checked)."""
    mlflow_run, got = mlflow_history(uri, run_dir)  # one MLflow run for the run directory
    want = series_of(expected)
    assert sorted(got) == sorted(want)
    for name, points in want.items():
        assert [s for s, _ in got[name]] == [s for s, _ in points], name  # each step once, in order
        assert [v for _, v in got[name]] == pytest.approx([v for _, v in points], rel=1e-6), name
    assert mlflow_run.info.status == "FINISHED"
    if resumed_at != "any":
        assert mlflow_run.data.tags.get("dream_trainer.resumed_at_step") == resumed_at

    ids, rows = wandb_history(run_dir)
    assert len(ids) == 1  # every process logged to the same W&B run
    assert [(s, sorted(m)) for s, m in rows] == [(s, sorted(m)) for s, m in expected]  # each row once, in order
    for (_, got_metrics), (_, metrics) in zip(rows, expected, strict=True):
        assert got_metrics == pytest.approx(metrics, rel=1e-6)


@pytest.mark.usefixtures("offline")
def test_a_run_stopped_by_an_exception_and_resumed_continues_the_tracker_runs(
    server: str, tmp_path: Path, uninterrupted: History
) -> None:
    first = run(tmp_path, server, stop="exception")
    mlflow_id = first.loggers[1].run_id
    assert max(s for s, _ in mlflow_history(server, first.run_dir)[1]["loss"]) == STOP_AT  # 9-10: after step 8
    resumed = run(tmp_path, server, ckpt_path="last")
    assert resumed.run_dir == first.run_dir and resumed.loggers[1].run_id == mlflow_id
    check(server, resumed.run_dir, uninterrupted)


@pytest.mark.usefixtures("offline")
def test_a_killed_run_resumed_continues_the_tracker_runs(server: str, tmp_path: Path, uninterrupted: History) -> None:
    module, root = Path(__file__).stem, str(tmp_path)
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import {module} as m; "
        f"m.run(m.Path({root!r}), {server!r}, 'kill')"
    )
    proc = subprocess.run([python(), "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (first,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("version_")]
    resumed = run(tmp_path, server, ckpt_path="last")
    assert resumed.run_dir == first
    check(server, first, uninterrupted)


@pytest.mark.usefixtures("offline")
def test_a_second_fit_of_the_same_trainer_logs_each_step_once(
    server: str, tmp_path: Path, uninterrupted: History
) -> None:
    trainer = make_trainer(tmp_path, server, stop="exception")
    fit(trainer)  # stops at step 10, after the checkpoint at step 8
    fit(trainer, ckpt_path="last")  # the same trainer and loggers, from the checkpoint: steps 9-10 again
    check(server, trainer.run_dir, uninterrupted, resumed_at="any")  # the trainer may or may not call resume()

    trainer.config.n_epochs = 3  # and once more, continuing past the end: steps 17-24 are added
    trainer.fit()
    _, series = mlflow_history(server, trainer.run_dir)
    assert [s for s, _ in series["loss"]] == list(range(1, 25))
    assert [s for s, _ in series["val_loss"]] == [8, 16, 24]
    _, rows = wandb_history(trainer.run_dir)
    assert [s for s, m in rows if "loss" in m] == list(range(1, 25))

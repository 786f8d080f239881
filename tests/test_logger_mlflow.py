"""MLFlowLogger against a real MLflow tracking server (a subprocess on 127.0.0.1, SQLite backend,
artifacts served by the server): what a run leaves there, read back with `MlflowClient`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import MemoryLogger
from dream_trainer.loggers.background import LoggerWriteError
from dream_trainer.loggers.mlflow import MLFlowLogger, flatten_params

if TYPE_CHECKING:
    from mlflow import MlflowClient

# mlflow is imported by the tests that use it (`mlflow_client`), not as pytest collects this file: ~2 s of CPU in every
# xdist worker, where only one runs these tests (an xdist group: tests/conftest.py).
needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="the mlflow extra is not installed: pip install -e '.[mlflow]'"
)

pytestmark = [needs_mlflow, pytest.mark.slow]  # the server takes a few seconds to start (once per test process)


def mlflow_client(uri: str) -> MlflowClient:
    """`MlflowClient(tracking_uri=uri)`, to read back what a run left on the server."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The server this test process started, shared by every module that uses the `server` fixture
# (test_logger_resume_trackers takes it from here): {"uri", "users", "stop"}.
_SERVER: dict[str, Any] = {}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A tracking server on 127.0.0.1, started once per test process (the tests that use it form one
    xdist group) and stopped after the last module using it; the tests keep apart by experiment name."""
    if not _SERVER:
        _SERVER.update(uri=None, users=0, stop=contextlib.ExitStack())
        try:
            _SERVER["uri"] = _SERVER["stop"].enter_context(_start_server(tmp_path_factory))
        except BaseException:
            _SERVER.clear()
            raise
    _SERVER["users"] += 1
    try:
        yield _SERVER["uri"]
    finally:
        _SERVER["users"] -= 1
        if _SERVER["users"] == 0:
            stop = _SERVER.pop("stop")
            _SERVER.clear()
            stop.close()


@contextlib.contextmanager
def _start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed below
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    # No job runner (a third process importing mlflow, for server-side jobs these tests never start).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    # its own process group: the server runs uvicorn in a child process, stopped with it below
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def fast_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow retries a failed request with backoff for minutes by default; a test wants the error now.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def test_run_holds_params_metrics_tags_checkpoint_and_finished(server: str, tmp_path: Path) -> None:
    memory = MemoryLogger()
    logger = MLFlowLogger(experiment_name="test-fit", tracking_uri=server, tags={"team": "vision"}, flush_secs=0.2)
    config = quiet_config(
        tmp_path, n_epochs=2, log_every_n_steps=1, loggers=[logger, memory], enable_checkpointing=True
    )
    trainer = TinyTrainer(config)
    trainer.fit()

    client = mlflow_client(server)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == trainer.run_dir.name
    assert client.get_experiment(run.info.experiment_id).name == "test-fit"

    # params: the config, flat, as strings
    assert run.data.params == dict(flatten_params(trainer.config.to_dict()))
    assert run.data.params["n_epochs"] == "2" and run.data.params["log_every_n_steps"] == "1"
    assert run.data.params["loggers"] == "['MLFlowLogger', 'MemoryLogger']"

    # metrics: every step's value, exactly what the MemoryLogger of the same run received
    names = {name for _, metrics in memory.history for name in metrics}
    assert {"loss", "val_loss"} <= names and set(run.data.metrics) == names
    for name in names:
        history = sorted(client.get_metric_history(logger.run_id, name), key=lambda m: (m.step, m.timestamp))
        assert [(m.step, m.value) for m in history] == memory.series(name), name
    assert [s for s, _ in memory.series("loss")] == list(range(1, 9))  # logged every step

    assert run.data.tags["team"] == "vision"
    assert run.data.tags["dream_trainer.run_dir"] == str(trainer.run_dir)

    # the final checkpoint, uploaded byte for byte
    artifacts = {a.path: a.file_size for a in client.list_artifacts(logger.run_id, "checkpoints")}
    local = trainer.checkpoint_dir / "last.ckpt"
    assert artifacts == {"checkpoints/last.ckpt": local.stat().st_size}
    downloaded = client.download_artifacts(logger.run_id, "checkpoints/last.ckpt", str(tmp_path / "dl"))
    assert Path(downloaded).read_bytes() == local.read_bytes()


class Exploding(TinyTrainer):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("boom at step 3")
        return super().training_step(batch, batch_idx)


def test_validate_after_fit_logs_to_the_run_and_leaves_it_finished(server: str, tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="test-validate", tracking_uri=server, flush_secs=0.2)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, loggers=[logger]))
    trainer.fit()
    trainer.validate()  # reopens the MLflow run to log to it, and closes it again
    client = mlflow_client(server)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(logger.run_id, "val_loss")] == [4, 4]  # fit's, validate's


def test_failed_fit_marks_the_run_failed_and_keeps_what_was_logged(server: str, tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="test-fail", tracking_uri=server, log_checkpoints=False)
    trainer = Exploding(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=1, loggers=[logger]))
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit()
    client = mlflow_client(server)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(logger.run_id, "loss")] == [1, 2, 3]
    assert client.list_artifacts(logger.run_id) == []


@pytest.mark.usefixtures("fast_failures")
def test_a_failed_write_is_raised_once_naming_the_logger(server: str) -> None:
    logger = MLFlowLogger(tracking_uri=server, run_id="0" * 32, flush_secs=0.1)  # no such run on the server
    logger.log_metrics({"loss": 1.0}, step=1)  # only queued: the training thread does not wait
    with pytest.raises(LoggerWriteError, match=r"MLFlowLogger: a background write failed: .*RESOURCE_DOES_NOT_EXIST"):
        logger.flush()
    logger.flush()  # raised once: the error is not repeated
    logger.finalize("failed")  # the failure path prints rather than raises


def test_nested_config_and_long_values_become_flat_mlflow_params(server: str, tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="test-params", tracking_uri=server, flush_secs=0.1)
    logger.attach(tmp_path / "run-a")
    params = {"optim": {"lr": 0.1, "betas": (0.9, 0.99)}, "long": "x" * 7000, "empty": {}, "none": None}
    logger.log_hyperparams(params)
    logger.log_metrics({"acc@1": 0.5}, step=0)
    with pytest.warns(UserWarning, match="'acc@1' is not valid in MLflow; logged as 'acc_1'"):
        logger.flush()
    logger.finalize("success")
    run = mlflow_client(server).get_run(logger.run_id)
    assert run.data.params == {
        "optim.lr": "0.1", "optim.betas": "(0.9, 0.99)", "long": "x" * 6000, "empty": "{}", "none": "None",
    }  # fmt: skip
    assert run.data.metrics == {"acc_1": 0.5} and run.info.run_name == "run-a"


def test_logging_only_queues(server: str) -> None:
    # The training thread never waits for the server: 1000 steps are queued in far less time than
    # one request takes, and nothing is sent before the worker's interval.
    logger = MLFlowLogger(experiment_name="test-queue", tracking_uri=server, flush_secs=60)
    start = time.perf_counter()
    for step in range(1000):
        logger.log_metrics({"loss": float(step)}, step)
    elapsed = time.perf_counter() - start
    assert logger.pending == 1000 and elapsed < 0.5, elapsed
    logger.finalize("success")
    history = mlflow_client(server).get_metric_history(logger.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1000))


def test_continuing_a_run_with_a_changed_config_keeps_its_params(server: str) -> None:
    # MLflow refuses to change a param: the run keeps its value, a warning names it, the new ones are added.
    first = MLFlowLogger(experiment_name="test-continue", tracking_uri=server, flush_secs=0.1)
    first.log_hyperparams({"lr": 0.1, "n_epochs": 2})
    first.log_metrics({"loss": 1.0}, step=1)
    first.finalize("success")
    again = MLFlowLogger(tracking_uri=server, run_id=first.run_id, flush_secs=0.1)
    again.log_hyperparams({"lr": 0.1, "n_epochs": 4, "new": "x"})
    again.log_metrics({"loss": 0.5}, step=2)
    with pytest.warns(UserWarning, match=r"changes params .* n_epochs='4' \(run: '2'\); the run keeps its values"):
        again.flush()
    again.finalize("success")
    run = mlflow_client(server).get_run(first.run_id)
    assert run.data.params == {"lr": "0.1", "n_epochs": "2", "new": "x"}
    assert run.info.status == "FINISHED"


def test_a_logger_used_by_another_run_logs_to_another_mlflow_run(server: str, tmp_path: Path) -> None:
    logger = MLFlowLogger(experiment_name="test-reuse", tracking_uri=server, flush_secs=0.1, log_checkpoints=False)
    client, run_ids = mlflow_client(server), []
    for name in ("a", "b"):
        trainer = TinyTrainer(quiet_config(tmp_path / name, n_epochs=1, log_every_n_steps=1, loggers=[logger]))
        trainer.fit()
        run_ids.append(logger.run_id)
        run = client.get_run(logger.run_id)
        assert run.data.tags["dream_trainer.run_dir"] == str(trainer.run_dir)
        assert [m.step for m in client.get_metric_history(logger.run_id, "loss")] == [1, 2, 3, 4]
    assert run_ids[0] != run_ids[1]


def test_a_resumed_logger_continues_the_run_and_sends_each_step_once(server: str, tmp_path: Path) -> None:
    # The stopped process logged steps 1-3 (metrics and images), its checkpoint was at step 1; the resumed
    # one logs 1-4 again: the same MLflow run, found through the run directory, one value per step.
    image = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    first = MLFlowLogger(experiment_name="test-resume", tracking_uri=server, flush_secs=0.1, log_checkpoints=False)
    first.attach(tmp_path / "run")
    for step in (1, 2, 3):
        first.log_metrics({"loss": float(step)}, step)
        first.log_images("sample", image, step)
    first.flush()  # killed: never finalized
    resumed = MLFlowLogger(experiment_name="test-resume", tracking_uri=server, flush_secs=0.1, log_checkpoints=False)
    resumed.attach(tmp_path / "run")
    resumed.resume(1)
    for step in (1, 2, 3, 4):
        resumed.log_metrics({"loss": 10.0 * step}, step)
        resumed.log_images("sample", image, step)
    resumed.finalize("success")
    assert resumed.run_id == first.run_id
    client = mlflow_client(server)
    history = sorted(client.get_metric_history(first.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    images = [a.path for a in client.list_artifacts(first.run_id, "images") if a.path.endswith(".png")]
    assert sorted(int(p.split("+step+")[1].split("+")[0]) for p in images) == [1, 2, 3, 4]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["dream_trainer.resumed_at_step"] == "1"


def test_a_resumed_run_whose_mlflow_run_was_deleted_logs_to_a_new_one(server: str, tmp_path: Path) -> None:
    first = MLFlowLogger(experiment_name="test-deleted", tracking_uri=server, flush_secs=0.1, log_checkpoints=False)
    first.attach(tmp_path / "run")
    first.log_metrics({"loss": 1.0}, 1)
    first.finalize("success")
    mlflow_client(server).delete_run(first.run_id)
    resumed = MLFlowLogger(experiment_name="test-deleted", tracking_uri=server, flush_secs=0.1, log_checkpoints=False)
    resumed.attach(tmp_path / "run")
    resumed.resume(1)
    resumed.log_metrics({"loss": 0.5}, 2)
    with pytest.warns(UserWarning, match=f"the MLflow run {first.run_id} of .* was deleted; the resumed run logs to"):
        resumed.flush()
    resumed.finalize("success")
    assert resumed.run_id != first.run_id
    assert [m.step for m in mlflow_client(server).get_metric_history(resumed.run_id, "loss")] == [2]

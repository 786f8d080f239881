"""MLFlowLogger with a local store, no server, against the real mlflow package: a SQLite file works; a
file store, which MLflow 3.13+ refuses unless `MLFLOW_ALLOW_FILE_STORE=true`, is an error whose first
line says what to pass or set, raised when the logger is built (or at the first write, when the
setting changed since)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_logger_mlflow
from conftest import TinyTrainer, quiet_config

from dream_trainer import MemoryLogger
from dream_trainer.errors import ConfigError
from dream_trainer.loggers.background import LoggerWriteError
from dream_trainer.loggers.mlflow import MLFlowLogger

# mlflow is imported by the tests, not as pytest collects this file (test_logger_mlflow.py says why); its tests run
# on the worker that runs test_logger_mlflow.py's (an xdist group: tests/conftest.py).
pytestmark = test_logger_mlflow.needs_mlflow


@pytest.fixture
def refusing_mlflow() -> None:
    """Skips a test where the installed MLflow takes file stores (MLflow < 3.13)."""
    import mlflow

    if not hasattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip(f"MLflow {mlflow.__version__} takes file stores")


needs_refusal = pytest.mark.usefixtures("refusing_mlflow")


@pytest.fixture
def no_mlflow_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0]


def _assert_says_what_to_do(first: str) -> None:
    assert "MLFLOW_ALLOW_FILE_STORE=true" in first and "tracking_uri='sqlite:///mlflow.db'" in first, first
    assert len(first) < 300, first


@pytest.mark.slow  # ~5 s: MLflow creates the SQLite store's tables
@pytest.mark.usefixtures("no_mlflow_settings")
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")  # MLflow's
def test_a_sqlite_store_needs_no_server_and_holds_the_run(tmp_path: Path) -> None:
    # The working directory is tmp_path (conftest): MLflow puts a SQLite store's artifacts in ./mlruns.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    memory = MemoryLogger()
    logger = MLFlowLogger(experiment_name="local", tracking_uri=uri, flush_secs=0.2)
    config = quiet_config(
        tmp_path, n_epochs=1, log_every_n_steps=1, loggers=[logger, memory], enable_checkpointing=True
    )
    TinyTrainer(config).fit()  # a checkpoint per epoch: flushed, and last.ckpt uploaded at the end

    client = test_logger_mlflow.mlflow_client(uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(logger.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == memory.series("loss") and len(history) == 4
    assert [a.path for a in client.list_artifacts(logger.run_id, "checkpoints")] == ["checkpoints/last.ckpt"]


@needs_refusal
@pytest.mark.usefixtures("no_mlflow_settings")
def test_a_file_store_is_refused_when_the_logger_is_built_saying_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        MLFlowLogger(tracking_uri="file:./mlruns")
    first = _first_line(e.value)
    assert first.startswith("MLFlowLogger(tracking_uri='file:./mlruns'): MLflow ")
    _assert_says_what_to_do(first)
    with pytest.raises(ConfigError, match=r"^MLFlowLogger\(tracking_uri='/abs/mlruns'\): MLflow"):
        MLFlowLogger(tracking_uri="/abs/mlruns")  # a bare path is a file store too
    assert not (tmp_path / "mlruns").exists()  # nothing written


@needs_refusal
def test_a_file_store_in_mlflow_tracking_uri_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")
    with pytest.raises(ConfigError) as e:
        MLFlowLogger()
    first = _first_line(e.value)
    assert "MLFLOW_TRACKING_URI='./mlruns'" in first
    _assert_says_what_to_do(first)


@needs_refusal
@pytest.mark.usefixtures("no_mlflow_settings")
def test_mlflows_default_store_is_sqlite_unless_mlruns_holds_older_runs(tmp_path: Path) -> None:
    import mlflow

    MLFlowLogger()  # MLflow >= 3.7: sqlite:///mlflow.db in the working directory, which MLflow takes
    assert mlflow.get_tracking_uri().startswith("sqlite:")
    (tmp_path / "mlruns" / "0").mkdir(parents=True)  # what an older MLflow's default file store left
    (tmp_path / "mlruns" / "0" / "meta.yaml").write_text("name: Default\n")
    with pytest.raises(ConfigError) as e:
        MLFlowLogger()  # MLflow's default is then that file store, which it refuses
    first = _first_line(e.value)
    assert first.startswith("MLFlowLogger(tracking_uri=None): ") and "./mlruns" in first
    _assert_says_what_to_do(first)


@needs_refusal
def test_a_file_store_refused_at_the_first_write_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MLFlowLogger(tracking_uri="file:./mlruns", flush_secs=0.1)  # taken when built ...
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # ... refused when the worker first uses the store
    config = quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, loggers=[logger], enable_checkpointing=True)
    with pytest.raises(LoggerWriteError) as e:
        TinyTrainer(config).fit()
    first = _first_line(e.value)
    assert first.startswith("MLFlowLogger: a background write failed: ConfigError: MLFlowLogger(tracking_uri=")
    _assert_says_what_to_do(first)
    assert "MLflow: The filesystem tracking backend" in str(e.value)  # MLflow's own words, below
    assert isinstance(e.value.__cause__, ConfigError)


@pytest.mark.usefixtures("no_mlflow_settings")
def test_an_allowed_file_store_and_a_server_uri_are_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    MLFlowLogger(tracking_uri="http://127.0.0.1:1")  # nothing is contacted when the logger is built
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    MLFlowLogger(tracking_uri="file:./mlruns")

"""WandbLogger in offline mode: a real `wandb` run (its `wandb-core` service included) writes its
`.wandb` file; the records are read back with W&B's own protobuf (`wandb.proto.wandb_internal_pb2`).

wandb 0.31 ships no Python reader for that file any more (`wandb.sdk.internal.datastore` is gone;
`wandb-core` reads it), so `_records` below reads its framing: LevelDB's log format (32 KiB blocks,
records cut into FULL/FIRST/MIDDLE/LAST chunks, each behind a CRC, length and type header) after a
7-byte `:W&B` header. The network is never contacted: offline mode, and W&B's server address points
at a closed port.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyTrainer, quiet_config

from dream_trainer import MemoryLogger
from dream_trainer.loggers.wandb import STEP_METRIC, WandbLogger

# wandb is imported where it is used, not as pytest collects this file (and tests/test_logger_resume_trackers.py,
# which imports it): every xdist worker collects both, few of them run these tests.
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed: pip install -e '.[wandb]'"
)
pytestmark = [needs_wandb, pytest.mark.slow]  # W&B starts its service process per run (~1-2 s)

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[Any]:
    """Every `Record` of a `.wandb` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
        else:  # zeros: the end of what was written
            break
    from wandb.proto import wandb_internal_pb2

    return [wandb_internal_pb2.Record.FromString(r) for r in records]


def _items(updates: Any) -> dict[str, Any]:
    return {"/".join(u.nested_key) if u.nested_key else u.key: json.loads(u.value_json) for u in updates}


class OfflineRun:
    """What a `.wandb` file says: the run's name, history rows, the config, the final summary,
    artifacts, the exit code."""

    def __init__(self, path: Path) -> None:
        self.history: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}
        self.summary: dict[str, Any] = {}
        self.artifacts: list[Any] = []
        self.exit_code: int | None = None
        self.names: list[str] = []  # the display name of every run record (the run may be updated)
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.names.append(record.run.display_name)
                self.config.update(_items(record.run.config.update))
            elif kind == "config":
                self.config.update(_items(record.config.update))
            elif kind == "history":
                self.history.append(_items(record.history.item))
            elif kind == "summary":
                self.summary.update(_items(record.summary.update))
            elif kind == "artifact":
                self.artifacts.append(record.artifact)
            elif kind == "exit":
                self.exit_code = record.exit.exit_code


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    home = tmp_path / "wandb-home"
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed port: any network use would fail
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return home


def _offline_run(directory: Path) -> OfflineRun:
    # `run.finish()` hands the last records to W&B's service process, which writes the file on its own
    # time; stopping the service is the point where the file is complete.
    import wandb

    wandb.teardown()
    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    return OfflineRun(path)


@pytest.mark.usefixtures("offline")
def test_offline_run_holds_history_config_summary_and_checkpoint(tmp_path: Path) -> None:
    memory = MemoryLogger()
    logger = WandbLogger(project="dream-test", tags=["tiny"], flush_secs=0.2)
    config = quiet_config(
        tmp_path, n_epochs=2, log_every_n_steps=1, loggers=[logger, memory], enable_checkpointing=True
    )
    trainer = TinyTrainer(config)
    trainer.fit()
    run = _offline_run(trainer.run_dir)  # save_dir defaults to the run's directory

    # one history row per logging call, at the trainer's step, holding what the MemoryLogger got
    assert len(run.history) == len(memory.history)
    pairs = zip(run.history, memory.history, strict=True)
    assert [(row[STEP_METRIC], {k: row[k] for k in metrics}) for row, (_, metrics) in pairs] == memory.history
    assert [s for s, _ in memory.series("loss")] == list(range(1, 9))

    # the config, in W&B's config, as the trainer's values
    expected = json.loads(json.dumps(trainer.config.to_dict(), default=str))
    assert {k: run.config[k] for k in expected} == expected
    assert run.config["n_epochs"] == 2 and run.config["loggers"] == ["WandbLogger", "MemoryLogger"]
    assert trainer.run_dir.name in run.names, run.names  # the W&B run is named after the run directory

    # the summary: each metric's last value
    assert run.summary["loss"] == memory.series("loss")[-1][1]
    assert run.summary["val_loss"] == memory.series("val_loss")[-1][1]

    # the final checkpoint as a model artifact, and a clean exit
    (artifact,) = run.artifacts
    assert artifact.type == "model" and artifact.name.startswith("model-")
    entries = {e.path: e.size for e in artifact.manifest.contents}
    assert entries == {"last.ckpt": (trainer.checkpoint_dir / "last.ckpt").stat().st_size}
    assert run.exit_code == 0


class Exploding(TinyTrainer):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("offline")
def test_failed_fit_exits_the_run_with_code_1(tmp_path: Path) -> None:
    logger = WandbLogger(mode="offline", save_dir=tmp_path / "wb", log_checkpoints=False)
    trainer = Exploding(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, loggers=[logger]))
    with pytest.raises(RuntimeError, match="boom at step 2"):
        trainer.fit()
    run = _offline_run(tmp_path / "wb")  # save_dir given: W&B writes there, not in the run's directory
    assert [row[STEP_METRIC] for row in run.history] == [1, 2]
    assert run.exit_code == 1 and run.artifacts == []


@pytest.mark.usefixtures("offline")
def test_flush_returns_once_wandb_wrote_the_rows_to_its_file(tmp_path: Path) -> None:
    # W&B's service writes its file every 15 s by default: a process killed after a checkpoint would
    # lose the rows logged before it. flush() (called before every checkpoint) waits until they are in it.
    logger = WandbLogger(save_dir=tmp_path / "wb", flush_secs=0.1, log_checkpoints=False)
    for step in range(1, 6):
        logger.log_metrics({"loss": float(step)}, step)
    logger.flush()
    (path,) = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    assert [row[STEP_METRIC] for row in OfflineRun(path).history] == [1, 2, 3, 4, 5]
    logger.finalize("success")


@pytest.mark.usefixtures("offline")
def test_a_logger_used_by_another_run_logs_to_another_wandb_run(tmp_path: Path) -> None:
    logger = WandbLogger(flush_secs=0.1, log_checkpoints=False)
    ids = []
    for name in ("a", "b"):
        trainer = TinyTrainer(quiet_config(tmp_path / name, n_epochs=1, log_every_n_steps=1, loggers=[logger]))
        trainer.fit()
        (directory,) = trainer.run_dir.glob("wandb/offline-run-*")  # in each run's own directory
        ids.append(directory.name.rsplit("-", 1)[1])
        assert [row[STEP_METRIC] for row in _offline_run(trainer.run_dir).history] == [1, 2, 3, 4, 4, 4]
    assert ids[0] != ids[1]

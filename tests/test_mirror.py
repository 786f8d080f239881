"""The run directory's copy in a store (`mirror`, docs/object-store.md), in process, on a `file://` store:
what reaches the store and in which order, a fresh directory continuing from it exactly, what is never restored
(an uncommitted or damaged checkpoint), rotation deleting only the run's own keys, retries and failures counted,
the checkpoint of a signal durable before `fit()` returns, and the setting's checks. The same against a real S3
server, with faults and kill -9s, is tests/test_mirror_s3.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import plain_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, MirrorConfig
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.errors import ConfigError, TrainingInterrupted
from dream_trainer.loggers import CSVLogger
from dream_trainer.mirror import Store, StoreError


class Small(DreamTrainer):
    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def configure_dataloaders(self) -> Any:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("loss", loss)
        return loss


def _config(root: Path, store: Path | None, epochs: int, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "n_epochs": epochs, "seed": 3, "log_every_n_steps": 1, "enable_progress_bar": False,
        "loggers": [CSVLogger()], "mirror": None if store is None else f"file://{store}",
    }  # fmt: skip
    settings.update(overrides)
    return plain_config(root, **settings)


def _weights(trainer: DreamTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _keys(store: Path) -> list[str]:
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())


def test_a_fresh_directory_continues_from_the_store_exactly(tmp_path: Path) -> None:
    store = tmp_path / "store"
    reference = Small(_config(tmp_path / "reference", None, 4))
    reference.fit()
    first = Small(_config(tmp_path / "machine1", store, 2))
    first.fit()
    # Each checkpoint is in the store with its marker; run.json and the logs too; run.json counts the uploads.
    keys = _keys(store)
    assert "version_0/checkpoints/epoch=1-step=16.ckpt" in keys
    assert "version_0/checkpoints/epoch=1-step=16.ckpt.commit" in keys
    assert {"version_0/run.json", "version_0/config.yaml", "version_0/metrics.csv"} <= set(keys)
    assert "version_0/checkpoints/last.ckpt" not in keys  # an alias of the newest: never uploaded
    record = json.loads((store / "version_0/run.json").read_text())
    assert record["status"] == "success"
    assert record["mirror"]["failures"] == 0 and record["mirror"]["uploaded"] >= 4
    assert record["mirror"]["last_committed"] == "version_0/checkpoints/epoch=1-step=16.ckpt"

    # Another machine: an empty root_dir, the same config but 2 more epochs, "last".
    second = Small(_config(tmp_path / "machine2", store, 4))
    second.fit(ckpt_path="last")
    assert second.run_dir == tmp_path / "machine2" / "version_0"  # the same run, continued
    assert second.global_step == reference.global_step == 32
    for a, b in zip(_weights(second), _weights(reference), strict=True):
        assert torch.equal(a, b)
    # The run's history in the store: the uninterrupted run's, row for row (the first machine's rows kept).
    assert (store / "version_0/metrics.csv").read_text() == (reference.run_dir / "metrics.csv").read_text()
    record = json.loads((store / "version_0/run.json").read_text())
    assert record["status"] == "success" and len(record["resumes"]) == 1


def test_an_uncommitted_or_damaged_checkpoint_is_never_restored(tmp_path: Path, capfd: Any) -> None:
    store = tmp_path / "store"
    every_8 = [ModelCheckpoint(every_n_train_steps=8, save_top_k=-1)]
    Small(_config(tmp_path / "m1", store, 3, callbacks=every_8)).fit()
    ckpts = store / "version_0/checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.commit")) == [
        "epoch=0-step=8.ckpt.commit", "epoch=1-step=16.ckpt.commit", "epoch=2-step=24.ckpt.commit",
    ]  # fmt: skip
    # An upload cut before its marker: the parts are there, the marker is not.
    (ckpts / "epoch=2-step=24.ckpt.commit").unlink()
    # A part whose bytes changed after its marker was written (one flipped bit).
    part = ckpts / "epoch=1-step=16.ckpt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    fresh = Small(_config(tmp_path / "m2", store, 3, callbacks=[ModelCheckpoint(every_n_train_steps=8)]))
    fresh.fit(ckpt_path="last")
    err = capfd.readouterr().err
    assert "skipping version_0/checkpoints/epoch=1-step=16.ckpt in the store" in err and "CRC-32" in err
    assert "downloaded version_0/checkpoints/epoch=0-step=8.ckpt" in err
    assert "(global step 8)" in err
    assert not list((tmp_path / "m2/version_0/checkpoints").glob(".*pull*"))  # no partial download left
    reference = Small(_config(tmp_path / "reference", None, 3))
    reference.fit()
    for a, b in zip(_weights(fresh), _weights(reference), strict=True):
        assert torch.equal(a, b)


def test_rotation_deletes_only_this_runs_keys_and_a_new_run_takes_a_free_name(tmp_path: Path) -> None:
    store = tmp_path / "store"
    Small(_config(tmp_path / "m0", store, 1, run_name="other")).fit()
    other = {k: (store / k).read_bytes() for k in _keys(store)}
    rotate = [ModelCheckpoint(every_n_train_steps=2, save_top_k=1)]
    first = Small(_config(tmp_path / "m1", store, 2, run_name="mine", callbacks=rotate))
    first.fit()
    local = sorted(p.name for p in (first.run_dir / "checkpoints").iterdir() if p.name != "last.ckpt")
    in_store = sorted(k.split("/")[-1] for k in _keys(store) if k.startswith("mine/checkpoints/"))
    assert local == ["epoch=1-step=16.ckpt"]
    assert in_store == ["epoch=1-step=16.ckpt", "epoch=1-step=16.ckpt.commit"]  # the 7 rotated away: deleted
    assert {k: (store / k).read_bytes() for k in other} == other  # the other run's files, untouched
    # A new run on an empty machine takes a name no run in the store has.
    new = Small(_config(tmp_path / "m2", store, 1, run_name="mine"))
    new.fit()
    assert new.run_dir.name == "mine-v1"
    assert json.loads((store / "mine/run.json").read_text())["status"] == "success"


class FailingUploads:
    """The local file system's `open` for writing fails for keys containing `match` while `active`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, match: str) -> None:
        from fsspec.implementations.local import LocalFileSystem

        self.active, self.calls = True, 0
        original = LocalFileSystem._open

        def _open(fs: Any, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            if self.active and "w" in mode and match in path:
                self.calls += 1
                raise OSError(f"injected: 503 Slow Down for {path}")
            return original(fs, path, mode, *args, **kwargs)

        monkeypatch.setattr(LocalFileSystem, "_open", _open)


def test_retries_are_counted_and_a_failed_upload_keeps_the_local_copy_until_the_next_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    store = tmp_path / "store"
    mirror = MirrorConfig(url=f"file://{store}", retries=2, backoff_s=0.001)
    failing = FailingUploads(monkeypatch, ".ckpt")
    keep_all = {"mirror": mirror, "callbacks": [ModelCheckpoint(save_top_k=-1)]}
    trainer = Small(_config(tmp_path / "m1", store, 1, **keep_all))
    trainer.fit()
    assert failing.calls == 3  # the first try and 2 retries
    err = capfd.readouterr().err
    assert "mirror: version_0/checkpoints/epoch=0-step=8.ckpt was not uploaded" in err
    assert "the local copy stays in" in err
    assert (trainer.run_dir / "checkpoints/epoch=0-step=8.ckpt").is_file()
    assert not list(store.rglob("*.commit"))
    counts = json.loads((trainer.run_dir / "run.json").read_text())["mirror"]
    assert (counts["retries"], counts["failures"]) == (2, 1)
    # The store is back: the next fit of this run, in the same directory, uploads what is missing.
    failing.active = False
    keep_all["callbacks"] = [ModelCheckpoint(save_top_k=-1)]
    again = Small(_config(tmp_path / "m1", store, 2, **keep_all))
    again.fit(ckpt_path="last")
    commits = sorted(p.name for p in store.rglob("*.commit"))
    assert commits == ["epoch=0-step=8.ckpt.commit", "epoch=1-step=16.ckpt.commit"]


def test_store_retries_transient_failures_with_backoff_and_not_permanent_ones(tmp_path: Path) -> None:
    waits: list[float] = []
    store = Store(MirrorConfig(url=f"file://{tmp_path}", retries=3, backoff_s=0.5), sleep=waits.append)
    tries = iter([ConnectionResetError("reset"), TimeoutError("slow"), None])

    def flaky() -> str:
        exc = next(tries)
        if exc is not None:
            raise exc
        return "ok"

    assert store.attempt("upload x", flaky) == "ok"
    assert store.counts["retries"] == 2 and len(waits) == 2
    assert 0.25 <= waits[0] <= 0.5 and 0.5 <= waits[1] <= 1.0  # doubling, with jitter
    with pytest.raises(StoreError, match="upload y: PermissionError"):
        store.attempt("upload y", lambda: (_ for _ in ()).throw(PermissionError("denied")))
    assert store.counts["retries"] == 2 and store.counts["failures"] == 1  # no retry for a refusal


class SignalAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signals_checkpoint_is_in_the_store_when_fit_ends(tmp_path: Path) -> None:
    store = tmp_path / "store"
    trainer = Small(_config(tmp_path / "m1", store, 4, callbacks=[SignalAt(11)]))
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    assert (store / "version_0/checkpoints/signal-epoch=1-step=11.ckpt.commit").is_file()
    assert json.loads((store / "version_0/run.json").read_text())["status"] == "interrupted"
    fresh = Small(_config(tmp_path / "m2", store, 4))
    fresh.fit(ckpt_path="last")
    reference = Small(_config(tmp_path / "reference", None, 4))
    reference.fit()
    for a, b in zip(_weights(fresh), _weights(reference), strict=True):
        assert torch.equal(a, b)


def test_the_setting_is_checked_when_the_config_is_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"root_dir = 's3://bucket/runs' is a URL: .* set mirror='s3://bucket/runs'"):
        plain_config(tmp_path, root_dir="s3://bucket/runs")
    with pytest.raises(ConfigError, match=r"mirror.url = 'bucket/runs' is invalid"):
        plain_config(tmp_path, mirror="bucket/runs")
    with pytest.raises(ConfigError, match=r"mirror.retries = -1 is invalid"):
        plain_config(tmp_path, mirror={"url": "s3://b/r", "retries": -1})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['key'\]"):
        plain_config(tmp_path, mirror={"url": "s3://b/r", "key": "secret"})
    config = plain_config(tmp_path, mirror={"url": "s3://b/runs/", "flush_timeout_s": 10})
    assert config.mirror == MirrorConfig(url="s3://b/runs", flush_timeout_s=10)
    assert config.to_dict()["mirror"]["url"] == "s3://b/runs"


def test_a_store_whose_package_is_missing_is_named_when_the_trainer_is_built(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"mirror.url = 'gs://bucket/runs' needs the 'gs' store: pip install "
                       r"\"dream-trainer\[gcs\]\" \(it installs gcsfs\)"):  # fmt: skip
        Small(plain_config(tmp_path, mirror="gs://bucket/runs"))

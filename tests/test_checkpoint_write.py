"""How checkpoint files are written: durable on close with write-back started while writing, the zip
checksums switch, and the optimizer-state format (the same as torch's distributed state-dict utilities)."""

from __future__ import annotations

import os
import sys
import zipfile

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch import nn

from dream_trainer.utils import durable_file
from dream_trainer.utils.checkpoint_io import atomic_save, read_checkpoint
from dream_trainer.utils.durable_file import DurableFile


def test_durable_file_hands_over_contiguous_ranges_and_fsyncs_on_close(tmp_path, monkeypatch):
    ranges, fsyncs = [], []
    record = lambda fd, off, n, flags: ranges.append((off, n)) or 0  # noqa: E731
    monkeypatch.setattr(durable_file, "_sync_file_range", lambda: record)
    real_fsync = os.fsync
    monkeypatch.setattr(durable_file.os, "fsync", lambda fd: fsyncs.append(fd) or real_fsync(fd))
    chunks = [os.urandom(n) for n in (700, 300, 1500, 10, 2000, 5)]
    f = DurableFile(tmp_path / "x", writeback_bytes=1000)
    for chunk in chunks:
        assert f.write(chunk) == len(chunk)
    assert fsyncs == []
    f.close()
    assert len(fsyncs) == 1
    assert (tmp_path / "x").read_bytes() == b"".join(chunks)
    # every range starts where the previous one ended, each at least 1000 bytes
    assert ranges == [(0, 1000), (1000, 1500), (2500, 2010)]


def test_sync_file_range_is_found_on_linux():
    if sys.platform.startswith("linux"):
        assert durable_file._sync_file_range() is not None


def test_durable_file_abort_skips_the_fsync(tmp_path, monkeypatch):
    fsyncs = []
    monkeypatch.setattr(durable_file.os, "fsync", lambda fd: fsyncs.append(fd))
    f = DurableFile(tmp_path / "x")
    f.write(b"partial")
    f.abort()
    assert f.closed and fsyncs == []


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(64, 64), "step": 3, "name": "run"}


def test_atomic_save_keeps_zip_checksums_by_default(tmp_path):
    path = atomic_save(_state(), tmp_path / "a.ckpt")
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every member's CRC-32 is right
    assert torch.equal(read_checkpoint(path)["w"], _state()["w"])


def test_atomic_save_without_checksums_loads_the_same_and_restores_torchs_switch(tmp_path):
    before = torch.serialization.get_crc32_options()
    path = atomic_save(_state(), tmp_path / "b.ckpt", crc32=False)
    assert torch.serialization.get_crc32_options() == before
    loaded = read_checkpoint(path)
    assert torch.equal(loaded["w"], _state()["w"]) and loaded["step"] == 3 and loaded["name"] == "run"
    with zipfile.ZipFile(path) as z, pytest.raises(zipfile.BadZipFile, match="CRC"):
        z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))  # the documented trade-off


def test_checkpoint_crc32_false_resumes_like_the_default(tmp_path):
    for crc in (True, False):
        trainer = TinyTrainer(quiet_config(tmp_path / str(crc), n_epochs=1, checkpoint_crc32=crc))
        trainer.fit()
        trainer.save_checkpoint(tmp_path / f"{crc}.ckpt")
    a, b = (read_checkpoint(tmp_path / f"{crc}.ckpt") for crc in (True, False))
    assert torch.equal(a["models"]["model"]["weight"], b["models"]["model"]["weight"])
    resumed = TinyTrainer(quiet_config(tmp_path / "r", n_epochs=1, checkpoint_crc32=True))
    resumed.load_checkpoint(tmp_path / "False.ckpt")  # a resumable difference: no warning needed
    assert resumed.global_step == 4


class TwoGroups(TinyTrainer):
    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(
            [{"params": self.model[0].parameters(), "lr": 0.01}, {"params": self.model[1].parameters()}], lr=0.001
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)


def test_optimizer_state_is_keyed_by_name_like_torchs_state_dict_utilities(tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    trainer = TwoGroups(quiet_config(tmp_path, n_epochs=1))
    trainer.fit()
    ours = trainer.state_dict()["optimizers"]["optimizer"]
    theirs = get_optimizer_state_dict(
        trainer._all_models(), trainer.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["param_groups"][0]["params"] == ["model.0.weight", "model.0.bias"]
    assert (
        set(ours["state"])
        == set(theirs["state"])
        == {"model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"}
    )
    for name, entry in ours["state"].items():
        assert entry.keys() == theirs["state"][name].keys()
        for key, value in entry.items():
            assert torch.equal(value, theirs["state"][name][key])

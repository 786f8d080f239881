"""Sharded (DCP) checkpoints: written by FSDP, loaded anywhere, and never unpickled unsafely."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import CheckpointError
from dream_trainer.utils.checkpoint_io import TRAINER_STATE, atomic_save, is_sharded_checkpoint


class _Boom:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fake_sharded_dir(root: Path, metadata_payload: object) -> Path:
    ckpt = root / "evil.ckpt"
    ckpt.mkdir(parents=True)
    trainer = TinyTrainer(quiet_config(root))
    atomic_save(trainer.state_dict(), ckpt / TRAINER_STATE)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata_payload))
    return ckpt


def test_hostile_dcp_metadata_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = _fake_sharded_dir(tmp_path, _Boom(marker))
    assert is_sharded_checkpoint(ckpt)
    trainer = TinyTrainer(quiet_config(tmp_path))
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(ckpt)
    assert "not allowed" in str(info.value) and "posix.system" in str(info.value)
    assert not marker.exists()  # the command never ran


def test_metadata_unpickler_allows_dcp_metadata_only():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from dream_trainer.utils.sharded_checkpoint import _MetadataUnpickler

    ok = pickle.dumps([ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([3])), torch.float32])
    import io

    assert _MetadataUnpickler(io.BytesIO(ok)).load()[1] is torch.float32
    for forbidden in (os.system, print, torch.load):
        with pytest.raises(pickle.UnpicklingError):
            _MetadataUnpickler(io.BytesIO(pickle.dumps(forbidden))).load()


@pytest.mark.slow
def test_fsdp_shards_over_a_mesh_of_the_trainers_device_not_fsdp2s_default(tmp_path, monkeypatch):
    """FSDP2's own default mesh is a CUDA one whenever a GPU is visible: with device="cpu" on a GPU machine
    (seen on an H100, 2026-11-27) it moved the model to cuda:0, and a second rank failed in
    `cuda.set_device(1)`. The strategy shards over its own mesh of the trainer's device type instead."""
    import importlib

    fully_shard_module = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")

    def no_default_mesh():
        raise AssertionError("fully_shard built FSDP2's default mesh")

    monkeypatch.setattr(fully_shard_module, "_init_default_mesh", no_default_mesh)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, strategy="fsdp", device="cpu"))
    trainer.fit()
    assert trainer.parallel.fsdp_mesh.device_type == "cpu" and trainer.parallel.fsdp_mesh.size() == 1
    assert {p.device.type for p in trainer.model.parameters()} == {"cpu"}


def test_single_process_fsdp_writes_a_sharded_checkpoint_that_plain_training_resumes(tmp_path):
    """FSDP on one process (a one-member process group) writes a DCP directory; a plain
    single-process trainer resumes from it, and ends where an uninterrupted plain run ends."""
    from dream_trainer.utils import unwrap

    reference = TinyTrainer(quiet_config(tmp_path / "ref", n_epochs=2))
    torch.manual_seed(0)
    reference.model.reset_parameters()
    start = {k: v.clone() for k, v in reference.model.state_dict().items()}
    reference.fit()

    first = TinyTrainer(quiet_config(tmp_path / "run", n_epochs=1, strategy="fsdp", enable_checkpointing=True))
    first.model.load_state_dict(start)
    first.fit()
    ckpt = tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(ckpt) and (ckpt / ".metadata").is_file()

    resumed = TinyTrainer(quiet_config(tmp_path / "run", n_epochs=2))
    resumed.fit(ckpt_path="last")
    assert resumed.global_step == reference.global_step
    for k, v in unwrap(reference.model).state_dict().items():
        assert torch.allclose(resumed.model.state_dict()[k], v, atol=1e-6), k

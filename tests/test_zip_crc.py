"""Zip CRC-32s computed beside the write: the file is byte for byte what torch.save writes with its own
checksums, torch's global switch is back before the first byte, and anything unexpected falls back."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from dream_trainer.utils import checkpoint_io, zip_crc
from dream_trainer.utils.checkpoint_io import atomic_save, read_checkpoint
from dream_trainer.utils.durable_file import DurableFile


def _comparable(path: Path) -> tuple[bytes, list[tuple[str, int, int, int]]]:
    """The file's bytes and its members, with the one part that differs between any two saves
    blanked: the random serialization id (its bytes, and its CRC in the data descriptor and the
    central directory)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every CRC-32 is right
        infos = z.infolist()
    sid = next(i for i in infos if i.filename.endswith(".data/serialization_id"))
    start = sid.header_offset + 30 + len(sid.filename) + struct.unpack_from("<H", data, sid.header_offset + 28)[0]
    data[start : start + sid.file_size] = bytes(sid.file_size)
    crc = struct.pack("<I", sid.CRC)
    assert data.count(crc) == 2  # the data descriptor and the central directory entry
    members = [(i.filename, i.header_offset, i.CRC, i.file_size) for i in infos if i is not sid]
    return bytes(data).replace(crc, bytes(4)), members


def _big_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 7))  # 1.4 MB weight: the helper-thread path
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 600)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "empty": torch.empty(0), "n": 3, "s": "x"}


@pytest.mark.parametrize("state", [{"w": torch.arange(10), "xs": [torch.ones(3, 3), 1.5]}, _big_state()])
def test_parallel_checksums_write_the_same_bytes_as_torch(tmp_path, state):
    torch_file = DurableFile(tmp_path / "torch")  # a file object on both sides: the same archive name
    torch.save(state, torch_file)
    torch_file.close()
    atomic_save(state, tmp_path / "ours")
    assert _comparable(tmp_path / "ours") == _comparable(tmp_path / "torch")
    assert torch.serialization.get_crc32_options() is True


def test_torchs_checksum_switch_is_back_before_the_first_byte_is_written(tmp_path, monkeypatch):
    seen = []
    real_write = zip_crc.ChecksummingFile.write

    def write(self, data):
        out = real_write(self, data)  # the first call restores the switch before writing
        seen.append(torch.serialization.get_crc32_options())
        return out

    monkeypatch.setattr(zip_crc.ChecksummingFile, "write", write)
    atomic_save({"w": torch.ones(4)}, tmp_path / "a")
    assert seen and all(seen)


def test_an_unknown_archive_layout_falls_back_to_torchs_own_checksums(tmp_path, monkeypatch):
    def refuse(self):
        raise zip_crc.ZipCrcError("not the layout this code knows")

    monkeypatch.setattr(zip_crc.ChecksummingFile, "fill_zip_crcs", refuse)
    path = atomic_save({"w": torch.arange(5)}, tmp_path / "a.ckpt")
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert torch.equal(read_checkpoint(path)["w"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no temporary left behind


def test_zip64_extra_field_supplies_the_overflowed_values():
    fields = [0] * 17
    fields[8], fields[9], fields[16] = 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF
    extra = struct.pack("<HH", 0x5455, 1) + b"\0" + struct.pack("<HHQQQ", 0x0001, 24, 5 << 32, 6 << 32, 7 << 32)
    # order in the field: uncompressed size, compressed size, local header offset
    assert zip_crc._zip64_values(tuple(fields), extra) == (6 << 32, 7 << 32)
    with pytest.raises(zip_crc.ZipCrcError, match="zip64"):
        zip_crc._zip64_values(tuple(fields), b"")


def test_a_failed_save_leaves_no_file_and_the_switch_restored(tmp_path):
    with pytest.raises(Exception):  # noqa: B017 - torch's own pickling error type varies by version
        atomic_save({"f": lambda: 0}, tmp_path / "a.ckpt")
    assert list(tmp_path.iterdir()) == []
    assert torch.serialization.get_crc32_options() is True
    assert checkpoint_io._crc_lock.acquire(blocking=False)  # released on the failure path too
    checkpoint_io._crc_lock.release()


@pytest.mark.slow  # 70k records: about 4 s
def test_an_archive_with_more_than_65535_records_uses_the_zip64_directory(tmp_path, monkeypatch):
    filled = []
    real_fill = zip_crc.ChecksummingFile.fill_zip_crcs
    monkeypatch.setattr(zip_crc.ChecksummingFile, "fill_zip_crcs", lambda self: filled.append(real_fill(self)))
    state = [torch.full((2,), float(i)) for i in range(70_000)]
    path = atomic_save(state, tmp_path / "many.ckpt")
    assert filled  # our checksums, not the fallback to torch's
    assert b"PK\x06\x06" in path.read_bytes()[-200:]  # the zip64 end-of-central-directory record
    with zipfile.ZipFile(path) as z:
        assert len(z.infolist()) > 0xFFFF and z.testzip() is None
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(loaded, state, strict=True))

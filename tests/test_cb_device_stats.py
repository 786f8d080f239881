"""DeviceStatsMonitor: CPU memory logged on cadence; the CUDA path reads and resets the peak."""

from __future__ import annotations

import mmap

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import ConfigError, MemoryLogger
from dream_trainer.callbacks.device_stats import DeviceStatsMonitor, cpu_peak_rss_bytes, cpu_rss_bytes


class Allocating(TinyTrainer):
    """Holds 128 MiB of touched memory from its third training step on."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 2 and not hasattr(self, "ballast"):
            # Fresh anonymous pages, each written, so resident: a tensor can come from memory the allocator
            # already holds resident (seen in CI: the same RSS before and after), which the RSS cannot show.
            size = 128 * 2**20
            self.ballast = mmap.mmap(-1, size)
            page = b"\1" * mmap.PAGESIZE
            for offset in range(0, size, mmap.PAGESIZE):
                self.ballast[offset : offset + mmap.PAGESIZE] = page
        return super().training_step(batch, batch_idx)


def test_cpu_memory_is_logged_every_n_steps_and_tracks_allocations(tmp_path):
    logger = MemoryLogger()
    trainer = Allocating(
        quiet_config(tmp_path, n_epochs=1, callbacks=[DeviceStatsMonitor(log_every_n_steps=2)], loggers=[logger])
    )
    trainer.fit()
    rss = logger.series("device_stats/cpu_rss_mb")
    peak = logger.series("device_stats/cpu_peak_rss_mb")
    assert [s for s, _ in rss] == [2, 4] and [s for s, _ in peak] == [2, 4]
    for (_, now), (_, top) in zip(rss, peak, strict=True):
        assert 10 < now < 1_000_000  # a process with torch loaded holds tens of MiB at least
        assert now <= top  # the peak is never below the size now
    assert rss[1][1] - rss[0][1] > 100  # the 128 MiB allocated at step 3 are resident at step 4
    # CPU-only run: no CUDA keys
    assert not [k for _, m in logger.history for k in m if k.startswith("device_stats/cuda")]


def test_default_cadence_and_cpu_off(tmp_path):
    logger = MemoryLogger()
    cfg = quiet_config(tmp_path, n_epochs=2, log_every_n_steps=4, callbacks=[DeviceStatsMonitor()], loggers=[logger])
    TinyTrainer(cfg).fit()
    assert [s for s, _ in logger.series("device_stats/cpu_rss_mb")] == [4, 8]

    logger = MemoryLogger()
    cfg = quiet_config(tmp_path, n_epochs=1, callbacks=[DeviceStatsMonitor(1, cpu=False)], loggers=[logger])
    TinyTrainer(cfg).fit()
    assert not [k for _, m in logger.history for k in m if k.startswith("device_stats/")]


def test_cpu_readers_agree_with_each_other():
    rss, peak = cpu_rss_bytes(), cpu_peak_rss_bytes()
    assert rss is not None and peak is not None
    assert 0 < rss <= peak * 1.01


def test_cuda_stats_read_then_reset_the_peak(monkeypatch):
    calls: list[str] = []
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append("max") or 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: calls.append("now") or 1 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: calls.append("reserved") or 4 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    cb = DeviceStatsMonitor(cpu=False)
    cb._cuda = torch.device("cuda", 0)  # what on_train_start sets when the trainer runs on CUDA
    assert cb.read() == {
        "device_stats/cuda_max_memory_allocated_gb": 3.0,
        "device_stats/cuda_memory_allocated_gb": 1.0,
        "device_stats/cuda_max_memory_reserved_gb": 4.0,
    }
    assert calls[-1] == "reset" and calls.index("max") < calls.index("reset")


def test_bad_cadence():
    with pytest.raises(ConfigError, match=r"DeviceStatsMonitor\(log_every_n_steps=0\)"):
        DeviceStatsMonitor(log_every_n_steps=0)

"""DeviceStatsMonitor: process memory on the CPU and, on CUDA, allocated and peak device memory."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]  # no resource module on Windows

PREFIX = "device_stats/"
_MB = 2**20
_GIB = 2**30


def cpu_rss_bytes() -> int | None:
    """Resident set size of this process now, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:  # Linux: "size resident shared ..." in pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cpu_peak_rss_bytes() -> int | None:
    """Largest resident set size of this process so far, in bytes (None where it cannot be read)."""
    if resource is None:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB elsewhere


class DeviceStatsMonitor(Callback):
    """Log memory use every `log_every_n_steps` training steps (default `config.log_every_n_steps`).

    With `cpu=True` (the process, in MiB):
    - `device_stats/cpu_rss_mb`: resident memory now (`/proc/self/statm`; the peak where that is missing);
    - `device_stats/cpu_peak_rss_mb`: the largest resident memory so far (`getrusage`; never below the former).

    When the trainer runs on CUDA (in GiB):
    - `device_stats/cuda_max_memory_allocated_gb`: peak tensor memory since the previous log; the peak
      is reset after each log, so every value is the peak of its own interval;
    - `device_stats/cuda_memory_allocated_gb`: tensor memory now;
    - `device_stats/cuda_max_memory_reserved_gb`: peak memory held by the caching allocator.

    Reading these is host-side bookkeeping: no device sync, and nothing runs on the other steps.
    """

    def __init__(self, log_every_n_steps: int | None = None, cpu: bool = True) -> None:
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ConfigError(
                f"DeviceStatsMonitor(log_every_n_steps={log_every_n_steps!r}) is invalid: "
                "expected a positive integer or None"
            )
        self.log_every_n_steps = log_every_n_steps
        self.cpu = cpu
        self._every = 1
        self._cuda: torch.device | None = None

    def on_train_start(self, trainer: TrainerProtocol) -> None:
        self._every = self.log_every_n_steps or trainer.config.log_every_n_steps
        device = trainer.device
        self._cuda = device if device.type == "cuda" and torch.cuda.is_available() else None
        if self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)  # the first interval starts with training

    def on_train_batch_end(self, trainer: TrainerProtocol, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.loop.step_ended_every(self._every):
            stats = self.read()
            if stats:
                trainer.log_metrics(stats, step=trainer.global_step)

    def read(self) -> dict[str, float]:
        """The current statistics (and, on CUDA, start a new peak interval)."""
        stats: dict[str, float] = {}
        if self.cpu:
            peak, rss = cpu_peak_rss_bytes(), cpu_rss_bytes()
            if rss is None:
                rss = peak
            elif peak is not None:
                # The kernel counts both from per-CPU counters that it sums approximately: on a 16-core machine
                # the peak read 1.5 MiB below the current size (2026-11-27). A peak is never below "now".
                peak = max(peak, rss)
            if rss is not None:
                stats[PREFIX + "cpu_rss_mb"] = rss / _MB
            if peak is not None:
                stats[PREFIX + "cpu_peak_rss_mb"] = peak / _MB
        if self._cuda is not None:
            dev = self._cuda
            stats[PREFIX + "cuda_max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / _GIB
            stats[PREFIX + "cuda_memory_allocated_gb"] = torch.cuda.memory_allocated(dev) / _GIB
            stats[PREFIX + "cuda_max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / _GIB
            torch.cuda.reset_peak_memory_stats(dev)
        return stats

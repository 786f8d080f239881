"""DistributedMixin: who this process is, which device it uses, and collectives.

On one process every collective is a no-op that returns its input, so trainer code can call them
unconditionally.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dream_trainer.errors import MisconfigurationError


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)  # type: ignore[arg-type]


class DistributedMixin:
    """Process identity (read from the environment `torchrun` sets), the device, and collectives."""

    config: Any

    def _init_process_identity(self) -> None:
        self.world_size: int = _env_int("WORLD_SIZE", 1)
        self.global_rank: int = _env_int("RANK", 0)
        self.local_rank: int = _env_int("LOCAL_RANK", 0)
        self.device: torch.device = self._resolve_device(self.config.device)

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in training."""
        return self.world_size > 1

    @property
    def is_global_zero(self) -> bool:
        """True on the process that writes logs, progress and checkpoints."""
        return self.global_rank == 0

    def _resolve_device(self, setting: str) -> torch.device:
        if setting == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", self.local_rank % torch.cuda.device_count())
            return torch.device("cpu")
        device = torch.device(setting)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return device

    def _init_distributed(self) -> None:
        """Join the process group when launched on several processes."""
        if self.world_size > 1:
            raise MisconfigurationError(
                f"WORLD_SIZE={self.world_size}: this version of dream_trainer trains on one process only; "
                "multi-process (DDP/FSDP) support is not implemented yet. Launch with a single process "
                "(python train.py, or torchrun --nproc_per_node 1)."
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # --- collectives: identity on one process ---------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across processes ("sum", "mean", "max", "min"); returns it unchanged on one."""
        if op not in ("sum", "mean", "max", "min"):
            raise ValueError(f"all_reduce op={op!r} is invalid: valid choices are 'sum', 'mean', 'max', 'min'")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The tensor of every process, in rank order (`[tensor]` on one process)."""
        return [tensor]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` as held by rank `src` (the object itself on one process)."""
        return obj

    def barrier(self) -> None:
        """Wait for every process (returns at once on one process)."""

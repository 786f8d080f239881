"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer state
are split over the ranks; each block gathers its parameters for its forward and backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.parallel.strategy import Strategy
from dream_trainer.utils.modules import unwrap


class FSDPStrategy(Strategy):
    """`config.strategy="fsdp"`. Runs on one process too (a one-member group), so a script behaves
    the same before it is launched on many."""

    name = "fsdp"

    def __init__(self, config: Any, world_size: int, global_rank: int, device: torch.device) -> None:
        super().__init__(config, world_size, global_rank, device)
        self._world_mesh: Any = None
        """The 1-D mesh over every rank that FSDP2 shards over, on this trainer's device type (setup)."""

    def validate(self) -> None:
        if self.device.type not in ("cuda", "cpu"):
            raise MisconfigurationError(
                f"strategy='fsdp' cannot run on device {self.device.type!r}: "
                "use device='cuda' or 'cpu', or strategy='ddp'"
            )

    @property
    def needs_process_group(self) -> bool:
        return True

    @property
    def shards_parameters(self) -> bool:
        return True

    def setup(self) -> None:
        if self.device.type == "cpu":
            from dream_trainer.parallel.rng import install_cpu_rng_tracker

            install_cpu_rng_tracker()  # meta-device init: without it every shard drew the same values
        # The world mesh on the trainer's own device type. FSDP2's default mesh takes CUDA whenever a GPU
        # is visible: with device="cpu" on a GPU machine it moved the model to cuda:0 (and set cuda:<rank>).
        from torch.distributed.device_mesh import init_device_mesh

        if self._world_mesh is None:  # a second fit() of the same trainer keeps its mesh
            self._world_mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp_shard",))

    @property
    def fsdp_mesh(self) -> Any:
        return self._world_mesh

    def wrap_model(self, model: nn.Module, hooks: Any) -> nn.Module:
        # The trainer's `apply_fully_shard` is an override point; its default is `data_parallel.apply_fsdp`.
        return hooks.apply_fully_shard(model)

    def is_sharded(self, model: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(unwrap(model), FSDPModule)

    @property
    def sharded_checkpoints(self) -> bool:
        return bool(self.config.fsdp_sharded_checkpoints)

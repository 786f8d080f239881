"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer state
are split over the ranks; each block gathers its parameters for its forward and backward."""

from __future__ import annotations

from typing import Any

from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.parallel.strategy import Strategy
from dream_trainer.utils.modules import unwrap


class FSDPStrategy(Strategy):
    """`config.strategy="fsdp"`. Runs on one process too (a one-member group), so a script behaves
    the same before it is launched on many."""

    name = "fsdp"

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

    def wrap_model(self, model: nn.Module, hooks: Any) -> nn.Module:
        # The trainer's `apply_fully_shard` is an override point; its default is `data_parallel.apply_fsdp`.
        return hooks.apply_fully_shard(model)

    def is_sharded(self, model: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(unwrap(model), FSDPModule)

    @property
    def sharded_checkpoints(self) -> bool:
        return bool(self.config.fsdp_sharded_checkpoints)

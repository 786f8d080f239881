"""Data parallel with `DistributedDataParallel`: every rank holds the whole model, gradients are
averaged in backward."""

from __future__ import annotations

from typing import Any

from torch import nn

from dream_trainer.parallel.strategy import Strategy


class DDPStrategy(Strategy):
    """`config.strategy="ddp"` (the default when launched on several processes)."""

    name = "ddp"

    def wrap_model(self, model: nn.Module, hooks: Any) -> nn.Module:
        if self.world_size == 1:
            return model  # DDP over one rank only adds a copy of every gradient
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=self.config.find_unused_parameters)

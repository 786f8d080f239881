"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer state
are split over the ranks; each block gathers its parameters for its forward and backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.parallel.strategy import Strategy
from dream_trainer.utils.modules import has_trainable_parameters, unwrap


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

    def wrap_model(self, model: nn.Module, hooks: Any) -> nn.Module:
        # The trainer's `apply_fully_shard` is an override point; its default is `shard_blocks`.
        return hooks.apply_fully_shard(model)

    def is_sharded(self, model: nn.Module) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(unwrap(model), FSDPModule)

    @property
    def sharded_checkpoints(self) -> bool:
        return bool(self.config.fsdp_sharded_checkpoints)


def shard_blocks(model: nn.Module, config: Any, mesh: Any = None) -> nn.Module:
    """The default FSDP2 policy: every block of a `ModuleList`/`Sequential` that holds trainable
    parameters is its own unit, then the root, over `mesh` (None: the whole world). Mixed precision
    follows `config.mixed_precision` (compute in bf16/fp16, gradients reduced in fp32);
    `config.fsdp_cpu_offload` offloads parameters to the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision)
    kwargs: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if config.fsdp_cpu_offload else OffloadPolicy(),
    }
    if mesh is not None:
        kwargs["mesh"] = mesh
    # Bottom-up, as FSDP2 requires: inner blocks are sharded before the modules that hold them.
    for module in reversed(list(model.modules())):
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for block in module:
                if has_trainable_parameters(block) and block is not model:
                    fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model

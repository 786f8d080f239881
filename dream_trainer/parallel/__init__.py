"""Parallelism: how training is spread over processes and devices.

One file per strategy, each a `Strategy` subclass (`strategy.py` is the interface). `STRATEGIES`
maps a `config.strategy` name to its class, imported when first used; adding a strategy is one new
file and one line here (see docs/architecture.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dream_trainer.parallel.strategy import Strategy

# name -> "module:Class". "auto" is not a strategy: it resolves to "ddp" on several processes, else "single".
STRATEGIES: dict[str, str] = {
    "single": "dream_trainer.parallel.single:SingleDeviceStrategy",
    "ddp": "dream_trainer.parallel.ddp:DDPStrategy",
    "fsdp": "dream_trainer.parallel.fsdp:FSDPStrategy",
    "model_parallel": "dream_trainer.parallel.model_parallel:ModelParallelStrategy",
}

# Degrees that need a device mesh (anything beyond flat data-parallel sharding).
_MESH_DEGREES = ("dp_replicate", "tensor_parallel", "pipeline_parallel", "context_parallel")


def resolve_strategy_name(setting: str, world_size: int, config: Any = None) -> str:
    """The strategy `config.strategy` names. "auto" is "model_parallel" when a mesh degree (dp_replicate,
    tensor/pipeline/context parallel) is above 1, else "ddp" on several processes and "single" on one;
    "fsdp" with a mesh degree is "model_parallel" too (FSDP2 is its data-parallel part)."""
    if config is not None and setting in ("auto", "fsdp") and any(getattr(config, d, 1) != 1 for d in _MESH_DEGREES):
        return "model_parallel"
    if setting == "auto":
        return "ddp" if world_size > 1 else "single"
    return setting


def strategy_class(name: str) -> type[Strategy]:
    """The `Strategy` subclass registered as `name` (a key of `STRATEGIES`)."""
    try:
        target = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}: valid choices are {sorted(STRATEGIES)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)

"""Data parallelism on a device mesh: FSDP2 / HSDP (`apply_fsdp`) and replication (`apply_ddp`).

Both compose with tensor parallelism: apply TP first (parameters become DTensors on the "tp" mesh),
then these, with a data-parallel mesh taken from the same root mesh (`ParallelDims.build_mesh`).

Both shard (or replicate) block by block, bottom-up: every child of an `nn.ModuleList` / `nn.Sequential`
that has trainable parameters is its own unit, then the root takes what is left. One unit's all-gather /
gradient reduction is one collective, and a unit's gradients are reduced as soon as its backward ends,
overlapping with the backward of the blocks before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dream_trainer.errors import ConfigError

__all__ = ["apply_ddp", "apply_fsdp", "iter_blocks"]


def iter_blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The children of every `ModuleList` / `Sequential` inside `model` that have trainable parameters,
    innermost first (the order FSDP2 needs: a unit must be wrapped before the module that holds it).
    `model` itself is never yielded, even when it is a `Sequential` child of nothing."""
    seen: set[int] = set()
    for module in reversed(list(model.modules())):
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for block in module:
                if block is model or id(block) in seen:
                    continue
                if any(p.requires_grad for p in block.parameters()):
                    seen.add(id(block))
                    yield block


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    mp_param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model` in place with FSDP2 `fully_shard`, per block then the root; returns `model`.

    `mesh`: None shards over the whole world (FSDP2's default mesh: a CUDA one whenever a GPU is visible,
    whatever the trainer's device; the trainer passes `trainer.parallel.fsdp_mesh`, on its own device);
    1-D (e.g. `mesh["dp_shard_cp"]`) shards every parameter over its ranks (FSDP); 2-D
    (e.g. `mesh["dp_replicate", "dp_shard"]`) shards over the second dimension and replicates over the
    first (HSDP: gradients are reduce-scattered within a shard group, then all-reduced across replicas).
    `mp_param_dtype` is the dtype blocks compute in (None: the parameters' own), `reduce_dtype` the one
    gradients are reduced in. `cpu_offload` keeps sharded parameters, gradients and optimizer state on the
    CPU. `reshard_after_forward=False` keeps gathered parameters until backward (more memory, one
    all-gather less per block); pass False under pipeline parallelism, where every microbatch would
    otherwise gather the blocks again. The root never reshards after forward (FSDP2's own default:
    backward needs its parameters first). Idempotent: a model already sharded is returned unchanged.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return model
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ConfigError(
            f"apply_fsdp got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: pass a 1-D mesh (FSDP, e.g. "
            "mesh['dp_shard_cp']) or a 2-D one (HSDP, e.g. mesh['dp_replicate', 'dp_shard'])"
        )
    policy: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=mp_param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for block in list(iter_blocks(model)):
        if not isinstance(block, FSDPModule):
            fully_shard(block, reshard_after_forward=reshard_after_forward, **policy)
    fully_shard(model, **policy)
    return model


def apply_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """Replicate `model` in place over the 1-D data-parallel `mesh` (e.g. `mesh["dp_replicate"]`):
    every rank keeps the whole model and gradients are all-reduced (averaged) in backward. Per block
    then the root, like `apply_fsdp`; returns `model` (no wrapper: parameter names are unchanged).

    Why `replicate` from `torch.distributed._composable.replicate_with_fsdp` (FSDP2's machinery with a
    replicate-only mesh) and not the alternatives, on torch 2.13 with tensor-parallel (DTensor) params:
    `DistributedDataParallel(process_group=...)` fails in its first bucket (`aten.cat` of mixed Tensor
    and DTensor), and `torch.distributed._composable.replicate` (the DDP-based one) trains but its
    DTensor workaround drops the TP parameters from `state_dict()`. The FSDP2-based one trains to the
    same weights as one process and keeps a normal state dict. Parameters become DTensors (`Replicate()`
    on `mesh`), so checkpoints go through `torch.distributed.checkpoint` like FSDP's. Like FSDP2 it
    synchronises every micro-batch of an accumulation window (`Strategy.defers_gradient_sync` says why).
    For plain 1-D DDP without TP `DistributedDataParallel` is still the faster choice (bucketed, C++
    reducer, one all-reduce per window).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    if isinstance(model, FSDPModule):  # ReplicateModule is an FSDPModule
        return model
    if mesh.ndim != 1:
        raise ConfigError(
            f"apply_ddp got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: pass the 1-D replicate mesh "
            "(mesh['dp_replicate']); to replicate and shard, use apply_fsdp with a 2-D mesh (HSDP)"
        )
    mp_policy = MixedPrecisionPolicy(param_dtype=mp_param_dtype, reduce_dtype=reduce_dtype)
    for block in list(iter_blocks(model)):
        if not isinstance(block, FSDPModule):
            replicate(block, mesh=mesh, mp_policy=mp_policy)
    replicate(model, mesh=mesh, mp_policy=mp_policy)
    return model

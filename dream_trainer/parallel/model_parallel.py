"""N-D parallelism on a `DeviceMesh`: data parallel (replicate x shard), tensor, pipeline and context
parallel, as torchtitan and Lightning's `ModelParallelStrategy` compose them.

The degrees come from the config (`dp_replicate`, `dp_shard`, `tensor_parallel`, `pipeline_parallel`,
`context_parallel`; see `dims.ParallelDims`). Setup applies, in this fixed order, the trainer's override
points (`mixins/parallelism.py`): float8 conversion -> `apply_tensor_parallel(tp_mesh)` ->
`apply_pipeline_parallel(pp_mesh)` -> `apply_activation_checkpointing()` -> `apply_compile()` ->
`apply_fully_shard(model)` per model (FSDP2 / HSDP over the data-parallel mesh, or replication when
there is no shard dimension) -> `init_weights()` when the models were built on the meta device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.parallel.dims import ParallelDims, dp_rank_and_size, fsdp_mesh, submesh
from dream_trainer.parallel.strategy import ParallelHooks, Strategy
from dream_trainer.utils.modules import unwrap


class ModelParallelStrategy(Strategy):
    """`strategy="model_parallel"`, chosen by "auto" (and "fsdp") when a degree beyond `dp_shard` is set.

    Holds the world `mesh` (`trainer.device_mesh`) and its named sub-meshes (`submesh(name)`).
    """

    name = "model_parallel"

    def validate(self) -> None:
        cfg = self.config
        self.dims = ParallelDims(
            dp_replicate=cfg.dp_replicate,
            dp_shard=cfg.dp_shard,
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            context_parallel=cfg.context_parallel,
            world_size=self.world_size,
        )
        if self.device.type not in ("cuda", "cpu"):
            raise MisconfigurationError(
                f"strategy='model_parallel' cannot run on device {self.device.type!r}: use device='cuda' or 'cpu'"
            )
        if self.dims.cp_enabled and self.device.type != "cuda":
            raise MisconfigurationError(
                f"context_parallel={self.dims.context_parallel} needs CUDA devices (ring attention runs on "
                f"the flash / efficient SDPA kernels); this run is on {self.device.type!r}. Set "
                "context_parallel=1, or launch on GPUs."
            )
        if self.dims.pp_enabled and not cfg.fsdp_sharded_checkpoints:
            raise MisconfigurationError(
                f"pipeline_parallel={self.dims.pipeline_parallel} with fsdp_sharded_checkpoints=False: each "
                "pipeline stage holds different parameters, so checkpoints must be sharded directories. "
                "Set fsdp_sharded_checkpoints=True (the default)."
            )
        if self.dims.pp_enabled and cfg.mixed_precision == "fp16":
            raise MisconfigurationError(
                f"pipeline_parallel={self.dims.pipeline_parallel} with mixed_precision='fp16': the pipeline "
                "schedule runs the backward itself, so the fp16 loss scaler cannot scale it. Use "
                "mixed_precision='bf16' (no scaler needed) or None."
            )
        if cfg.float8:
            from dream_trainer.parallel.float8 import check_float8_supported

            check_float8_supported(self.device)
        self.mesh: Any = None

    @property
    def needs_process_group(self) -> bool:
        return True

    def setup(self) -> None:
        self.mesh = self.dims.build_mesh(self.device.type)
        self._dp = dp_rank_and_size(self.mesh)
        if self.device.type == "cpu":
            from dream_trainer.parallel.rng import install_cpu_rng_tracker

            install_cpu_rng_tracker()  # torch has none for CPU meshes: every shard drew the same values

    def submesh(self, name: str) -> Any:
        """A named 1-D sub-mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp",
        "dp_cp"); None when its degrees are all 1."""
        return submesh(self.mesh, name)

    # --- data ---------------------------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self._dp[0]

    @property
    def data_parallel_size(self) -> int:
        return self._dp[1]

    # --- models -------------------------------------------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        return fsdp_mesh(self.mesh) is not None or self.dims.tp_enabled

    @property
    def compiles_models(self) -> bool:
        return True  # per block, before sharding (apply_compile), not around the wrapped model

    def scaler_for(self, scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
        if type(scaler) is not torch.amp.GradScaler:  # None (no fp16), or a user's subclass: kept
            return scaler
        # Its inf/NaN verdict covers the mesh of one gradient only; the gradients live on several.
        from dream_trainer.parallel.rng import MeshGradScaler

        return MeshGradScaler.like(scaler)

    def parallelize(self, hooks: ParallelHooks) -> None:
        """Run the trainer's whole-model override points in their fixed order (before `wrap_model`)."""
        cfg = self.config
        if cfg.float8:
            from dream_trainer.parallel.float8 import apply_float8

            for _, model in hooks.named_models():
                apply_float8(model, self.device)
        if self.dims.tp_enabled:
            tp_mesh = self.submesh("tp")
            hooks.apply_tensor_parallel(tp_mesh)
            from dream_trainer.parallel.tensor_parallel import check_tp_applied

            trained = [m for _, m in hooks.named_models() if any(p.requires_grad for p in m.parameters())]
            if trained and not any(_has_dtensor_on(m, tp_mesh) for m in trained):
                check_tp_applied(trained[0], tp_mesh)  # raises, naming the degree and what to do
        if self.dims.pp_enabled:
            hooks.apply_pipeline_parallel(self.submesh("pp"))
        super().parallelize(hooks)  # activation checkpointing
        if cfg.compile_model:
            hooks.apply_compile()

    def wrap_model(self, model: nn.Module, hooks: Any) -> nn.Module:
        if fsdp_mesh(self.mesh) is not None:
            return hooks.apply_fully_shard(model)
        replicate = self.submesh("dp_replicate")
        if replicate is not None:
            from dream_trainer.parallel.data_parallel import apply_ddp

            return apply_ddp(model, replicate, mp_param_dtype=_param_dtype(self.config))
        return model

    def total_grad_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """Per mesh (TP-sharded and FSDP-only gradients live on different meshes), then over the
        pipeline stages, which hold different parameters."""
        from dream_trainer.parallel.tensor_parallel import total_norm_of_grads

        norm = total_norm_of_grads(grads, norm_type)
        if self.dims.pp_enabled:
            group = self.submesh("pp").get_group()
            if math.isinf(norm_type):
                norm = norm.clone()
                torch.distributed.all_reduce(norm, op=torch.distributed.ReduceOp.MAX, group=group)
            else:
                powered = norm.pow(norm_type)
                torch.distributed.all_reduce(powered, group=group)
                norm = powered.pow(1.0 / norm_type)
        return norm

    def clip_grads_with_norm_(self, params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
        # torch's fused (foreach) kernels take one mesh at a time: clip each mesh's gradients apart.
        for group in _by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)

    def clip_grads_by_value_(self, params: list[torch.Tensor], value: float) -> None:
        for group in _by_mesh(params):
            torch.nn.utils.clip_grad_value_(group, value)

    @property
    def fsdp_mesh(self) -> Any:
        return fsdp_mesh(self.mesh)

    def is_sharded(self, model: nn.Module) -> bool:
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in unwrap(model).parameters())

    @property
    def sharded_checkpoints(self) -> bool:
        return bool(self.config.fsdp_sharded_checkpoints)

    def __repr__(self) -> str:
        shape, names = self.dims.mesh_shape()
        return f"ModelParallelStrategy(mesh={dict(zip(names, shape, strict=True))}, device={self.device})"


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` grouped by the mesh their gradients live on (plain tensors together)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def _param_dtype(config: Any) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision)


def _has_dtensor_on(model: nn.Module, mesh: Any) -> bool:
    from torch.distributed.tensor import DTensor

    names = set(mesh.mesh_dim_names or ())
    return any(isinstance(p, DTensor) and names <= set(p.device_mesh.mesh_dim_names or ()) for p in model.parameters())

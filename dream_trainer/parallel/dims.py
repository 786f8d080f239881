"""ParallelDims: how the world of processes is divided among the parallelisms, and the device mesh.

The degrees multiply to WORLD_SIZE. The mesh puts them in the order `("pp", "dp_replicate", "dp_shard",
"cp", "tp")`: the innermost dimension (tp) holds neighbouring ranks, which on a real cluster share a node
and its fast links, because tensor parallelism communicates in every layer; pipeline parallelism, which
only sends activations between stages, spans the farthest ranks.

Flattened sub-meshes, made by `build_mesh` and looked up with `submesh(mesh, "dp")`:

- `"dp"` = dp_replicate x dp_shard: the ranks that see different batches (data loading follows it);
- `"dp_shard_cp"` = dp_shard x cp: the ranks FSDP shards parameters over (context-parallel ranks hold
  the same weights, so they can share the shards);
- `"dp_cp"` = dp_replicate x dp_shard x cp: the ranks whose losses and metrics are averaged;
- `"dp_shard_cp_tp"` = dp_shard x cp x tp: one group for a reduction over FSDP-sharded tensor-parallel
  weights (the gradient norm), instead of two in a row.

A flattened name exists when at least one of its dimensions is in the mesh (dimensions of degree 1 are
left out of the mesh, except that a mesh always has one dimension: `"dp_shard"` of size 1 on one process).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dream_trainer.errors import ConfigError

__all__ = ["FLATTENED", "MESH_DIM_NAMES", "ParallelDims", "dp_rank_and_size", "fsdp_mesh", "submesh"]

#: Mesh dimension names, outermost first.
MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: Flattened sub-mesh name -> the mesh dimensions it joins (those of degree 1 are skipped).
FLATTENED: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    # The gradient norm over tensor-parallel weights on a (dp_shard, tp) mesh: one all-reduce over
    # one flattened mesh rather than two in a row (which DTensor warns may differ between ranks).
    "dp_shard_cp_tp": ("dp_shard", "cp", "tp"),
}


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degree of each parallelism; their product must equal `world_size`.

    `dp_shard=-1` (the default) takes every process the other degrees leave: on 8 processes,
    `ParallelDims(tensor_parallel=2, world_size=8)` resolves to dp_shard=4. The resolved value is stored,
    so `dims.dp_shard` is always a positive int after construction. Raises `ConfigError` otherwise.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    world_size: int

    def __post_init__(self) -> None:
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ConfigError(f"world_size={self.world_size!r} is invalid: it must be a positive int (WORLD_SIZE)")
        for name, value in self._degrees().items():
            if name == "dp_shard" and value == -1:
                continue
            if not _is_int(value) or value < 1:
                allowed = "a positive int" + (", or -1 for 'the rest of the world'" if name == "dp_shard" else "")
                raise ConfigError(f"{name}={value!r} is invalid: it must be {allowed}")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tensor_parallel * self.pipeline_parallel * self.context_parallel
            if self.world_size % others:
                raise ConfigError(
                    "dp_shard=-1 takes the processes the other degrees leave, but "
                    f"{self._product_text(skip='dp_shard')} = {others} does not divide WORLD_SIZE={self.world_size}: "
                    f"change the degrees so their product divides {self.world_size}, or launch a multiple of "
                    f"{others} processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        product = math.prod(self._degrees().values())
        if product != self.world_size:
            raise ConfigError(
                f"the parallel degrees do not multiply to the number of processes: {self._product_text()} = "
                f"{product}, but WORLD_SIZE={self.world_size}. Change the degrees so their product is "
                f"{self.world_size} (dp_shard=-1 takes whatever the others leave), or launch {product} processes"
            )

    def _degrees(self) -> dict[str, int]:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "context_parallel": self.context_parallel,
        }

    def _product_text(self, skip: str = "") -> str:
        return " x ".join(f"{k}={v}" for k, v in self._degrees().items() if k != skip)

    # --- what is on ----------------------------------------------------------------------------------
    @property
    def dp_replicate_enabled(self) -> bool:
        """Whole-model replicas (DDP, or the replicate dimension of HSDP)."""
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Parameters sharded with FSDP over dp_shard ranks."""
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        """More than one data-parallel rank (replicated or sharded)."""
        return self.dp_degree > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline_parallel > 1

    @property
    def cp_enabled(self) -> bool:
        return self.context_parallel > 1

    @property
    def dp_degree(self) -> int:
        """How many different batches one step sees: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_nd(self) -> bool:
        """True when anything beyond 1-D data parallelism is on (TP, PP, CP, or HSDP's two dp dimensions)."""
        hsdp = self.dp_replicate_enabled and self.dp_shard_enabled
        return self.tp_enabled or self.pp_enabled or self.cp_enabled or hsdp

    # --- the mesh ------------------------------------------------------------------------------------
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's (shape, dimension names): dimensions of degree > 1, outermost first."""
        pp, dpr, dps, cp, tp = (
            self.pipeline_parallel,
            self.dp_replicate,
            self.dp_shard,
            self.context_parallel,
            self.tensor_parallel,
        )
        sizes = dict(zip(MESH_DIM_NAMES, (pp, dpr, dps, cp, tp), strict=True))
        dims = [(n, s) for n, s in sizes.items() if s > 1] or [("dp_shard", 1)]
        return tuple(s for _, s in dims), tuple(n for n, _ in dims)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the world mesh (`init_device_mesh`, joins the default process group if needed) with the
        flattened sub-meshes of the module docstring. Every rank must call it (it creates process groups).

        `device_type` is "cpu" or "cuda" (no index): gloo on CPU, NCCL on CUDA, as the default group has.
        """
        shape, names = self.mesh_shape()
        if math.prod(shape) != self.world_size:  # pragma: no cover - __post_init__ guarantees it
            raise ConfigError(f"mesh shape {shape} does not match WORLD_SIZE={self.world_size}")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat_name in FLATTENED:
            submesh(mesh, flat_name)  # creates the flattened groups now, on every rank together
        return mesh


def submesh(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The 1-D sub-mesh `name` of the world `mesh` built by `ParallelDims.build_mesh`: a dimension
    ("pp", "dp_replicate", "dp_shard", "cp", "tp") or a flattened one ("dp", "dp_shard_cp", "dp_cp");
    None when none of its dimensions is in the mesh (their degrees are 1).

    Flattened meshes are looked up by flattening again (`_flatten` returns the one made before), not by
    `mesh["dp"]`: slicing a flattened name from the root mesh warns on torch 2.13 that it is deprecated.
    A name made of one present dimension is that dimension's own mesh. The first call for a flattened
    name creates process groups, so every rank must make it (`build_mesh` does, for all of them).
    """
    if name in MESH_DIM_NAMES:
        return mesh[name] if name in (mesh.mesh_dim_names or ()) else None
    if name not in FLATTENED:
        valid = ", ".join(repr(n) for n in (*MESH_DIM_NAMES, *FLATTENED))
        raise ValueError(f"submesh name={name!r} is invalid: valid choices are {valid}")
    present = tuple(n for n in FLATTENED[name] if n in (mesh.mesh_dim_names or ()))
    if not present:
        return None
    if len(present) == 1:
        return mesh[present[0]]
    # DeviceMesh has no public flatten on torch 2.13; `_flatten` is what torchtitan uses too.
    return mesh[present]._flatten(name)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh to give `apply_fsdp`: 1-D "dp_shard_cp" (FSDP), or 2-D ("dp_replicate", "dp_shard_cp")
    when there are replicas too (HSDP); None when neither dp_shard nor cp is above 1 (replicate only:
    use `apply_ddp(model, submesh(mesh, "dp_replicate"))`, or nothing)."""
    names = mesh.mesh_dim_names or ()
    shard = tuple(n for n in FLATTENED["dp_shard_cp"] if n in names)
    if not shard:
        return None
    if "dp_replicate" not in names:
        return submesh(mesh, "dp_shard_cp")
    if len(shard) == 1:
        return mesh["dp_replicate", shard[0]]
    submesh(mesh, "dp_shard_cp")
    with warnings.catch_warnings():
        # The one 2-D mesh that needs a flattened name next to a real one; no other API makes it on 2.13.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh["dp_replicate", "dp_shard_cp"]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's data-parallel (rank, size): which slice of the global batch it reads, and into how many
    slices the batch is cut. The ranks of one TP / CP / PP group get the same dp rank (they work on the
    same samples). `(0, 1)` when the mesh has no data-parallel dimension."""
    dp = submesh(mesh, "dp")
    if dp is None:
        return 0, 1
    return dp.get_local_rank(), dp.size()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""`Strategy`: the one interface every way of spreading training over processes implements.

The trainer's mixins never ask which strategy runs; they call the strategy object
(`trainer.parallel`): wrap a model, skip gradient sync inside an accumulation window, say whether a
model's state is sharded, reduce and gather across ranks, wait at a barrier. A new strategy is one
file in this package with a subclass, and one line in `STRATEGIES` (`parallel/__init__.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn

_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


class ParallelHooks(Protocol):
    """The trainer's whole-model override points a strategy's `parallelize` calls, in its order
    (`ParallelismMixin`). A strategy only calls them: it writes no attribute of the trainer."""

    def named_models(self) -> list[tuple[str, nn.Module]]: ...

    def apply_tensor_parallel(self, tp_mesh: Any) -> None: ...

    def apply_pipeline_parallel(self, pp_mesh: Any) -> None: ...

    def apply_activation_checkpointing(self) -> None: ...

    def apply_compile(self) -> None: ...


class Strategy:
    """Single process by default; subclasses change what differs.

    Args:
        config: the trainer's `DreamTrainerConfig` (validated).
        world_size / global_rank: from the launcher's environment (`torchrun`).
        device: the device this process trains on.
    """

    name: ClassVar[str] = "single"

    def __init__(self, config: Any, world_size: int, global_rank: int, device: torch.device) -> None:
        self.config = config
        self.world_size = world_size
        self.global_rank = global_rank
        self.device = device
        self.validate()

    # --- life cycle ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Refuse settings this strategy cannot run (called at trainer construction, before any compute)."""

    @property
    def needs_process_group(self) -> bool:
        """Whether `fit()` must join a process group (always with several processes)."""
        return self.world_size > 1

    def setup(self) -> None:
        """Called once the process group exists, before `configure_models` (build meshes here)."""

    # --- models -------------------------------------------------------------------------------------
    mesh: Any = None
    """The world `DeviceMesh` (only strategies built on one have it)."""

    def submesh(self, name: str) -> Any:
        """A named sub-mesh of `mesh` ("tp", "dp", ...); None without a mesh or when its degree is 1."""
        return None

    @property
    def fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards over (None: the whole world)."""
        return None

    @property
    def shards_parameters(self) -> bool:
        """True when `wrap_model` can take meta-device parameters (sharding first, allocating after)."""
        return False

    @property
    def compiles_models(self) -> bool:
        """True when the strategy compiles models itself (per block, through `apply_compile`)."""
        return False

    def scaler_for(self, scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler this strategy needs in place of `scaler` (the trainer's, or None); the
        trainer (`AMPMixin`, its owner) keeps what this returns. Default: `scaler` itself."""
        return scaler

    def parallelize(self, hooks: ParallelHooks) -> None:
        """Run the trainer's whole-model override points (`hooks` is the trainer) before `wrap_model`.
        Every strategy gets activation checkpointing; mesh strategies add theirs in front of it."""
        hooks.apply_activation_checkpointing()

    def wrap_model(self, model: nn.Module, hooks: Any) -> nn.Module:
        """Wrap a model that has trainable parameters (already on the device). `hooks` is the
        trainer, whose override points (`apply_fully_shard`, ...) a strategy calls. Default: as it is."""
        return model

    def defers_gradient_sync(self, model: nn.Module) -> bool:
        """True when an accumulation window runs every micro-batch of `model` but its last under `no_sync`
        (one gradient synchronisation per window): a DDP wrapper, whose unsynchronised gradients are the
        rank's own `p.grad`, which a checkpoint written inside the window saves.

        False for FSDP2 (`fully_shard`, and `replicate`, which is built on it): with its sync off FSDP2
        accumulates the unsharded gradients inside itself and leaves the sharded `p.grad` as it was until
        the window's last micro-batch, so a checkpoint or snapshot inside the window would miss them. With
        its sync on it reduce-scatters every micro-batch's gradients into `p.grad`, the whole window's
        gradient is there, and it holds no unsharded gradient between micro-batches (torchtitan does the
        same); it communicates once per micro-batch instead of once per window."""
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)

    def no_sync(self, models: Iterable[nn.Module]) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation of `models` for a forward/backward. Inside an accumulation window
        the trainer passes the models `defers_gradient_sync` picks (DDP's)."""
        stack = contextlib.ExitStack()
        m: Any  # nn.Module's __getattr__ types wrapper methods (no_sync, ...) as Tensor | Module
        for m in models:
            if hasattr(m, "no_sync"):  # DDP decides at forward time
                stack.enter_context(m.no_sync())
            elif hasattr(m, "set_requires_gradient_sync"):  # FSDP2
                m.set_requires_gradient_sync(False)
                stack.callback(m.set_requires_gradient_sync, True)
        return stack

    def total_grad_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The `norm_type`-norm (2 by default) of all `grads` together, as if no tensor were sharded (a
        plain tensor)."""
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor; the true norm over all shards
            norm = norm.full_tensor()
        return norm

    def clip_grads_with_norm_(self, params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
        """Scale the gradients of `params` so their total norm (`norm`, from `total_grad_norm`) is at
        most `max_norm`."""
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)

    def clip_grads_by_value_(self, params: list[torch.Tensor], value: float) -> None:
        """Clamp every gradient element of `params` to [-value, value]."""
        torch.nn.utils.clip_grad_value_(params, value)

    # --- state --------------------------------------------------------------------------------------
    def is_sharded(self, model: nn.Module) -> bool:
        """True when `model`'s parameters are split over ranks (its full state needs a collective)."""
        return False

    @property
    def sharded_checkpoints(self) -> bool:
        """True when checkpoints are written as `torch.distributed.checkpoint` directories."""
        return False

    # --- data ---------------------------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        """Which shard of the data this process reads (ranks that must see one batch share it)."""
        return self.global_rank

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees across the job."""
        return self.world_size

    # --- collectives: identity on one process -------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across processes in place ("sum", "mean", "max", "min") and return it."""
        if op not in _OPS:
            raise ValueError(f"all_reduce op={op!r} is invalid: valid choices are 'sum', 'mean', 'max', 'min'")
        if self._distributed:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _OPS[op]))
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The tensor of every process, in rank order (`[tensor]` on one process)."""
        if not self._distributed:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable), in rank order (`[obj]` on one process)."""
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's `obj` (picklable) on rank `dst`, in rank order; None on the other ranks
        (`[obj]` on one process). What only the writer of a file needs: `all_gather_object` would put
        every rank's copy on every rank."""
        if not self._distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.global_rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` as held by rank `src` (the object itself on one process)."""
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        """Wait for every process (returns at once on one process)."""
        if self._distributed:
            dist.barrier()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, device={self.device})"

"""Build on the meta device, shard, then materialize: a model too large for one device never exists whole.

    with torch.device("meta"):
        model = Transformer(cfg)             # shapes only, no memory
    apply_fsdp(model, mesh["dp_shard_cp"])   # parameters become sharded DTensors, still on meta
    materialize(model, "cuda", init_fn)      # each rank allocates and initializes its own shards

`init_fn` (or the modules' `reset_parameters`) runs on the sharded parameters: `torch.nn.init` functions
work on DTensors, each rank filling its shard. Values then differ from an unsharded init with the same
seed (DTensor draws random numbers per shard); load a checkpoint to start from given weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dream_trainer.errors import MisconfigurationError

__all__ = ["check_finite_weights", "check_materialized", "materialize"]


def _reset_fn(module: nn.Module) -> Callable[[], None] | None:
    """`module.reset_parameters`, or `_reset_parameters` (nn.MultiheadAttention's name for it)."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def materialize(
    model: nn.Module,
    device: torch.device | str,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Allocate `model`'s meta parameters and buffers on `device` (`model.to_empty`) and initialize them:
    `init_fn(model)` if given, else every module's own `reset_parameters()` (children before parents).
    Then `check_materialized`
    and `check_finite_weights(model, group=group)`. Returns `model`.

    Without `init_fn`, a module that owns parameters (directly) but has no `reset_parameters` is an error
    raised before allocating: `to_empty` leaves memory uninitialized, and garbage that happens to be finite
    would train silently. Buffers are initialized only by `init_fn` or `reset_parameters` too (BatchNorm's
    running stats are; a positional-frequency buffer computed in `__init__` is not: recompute it in
    `init_fn`).
    """
    if init_fn is None:
        _check_resettable(model)
    model.to_empty(device=device)
    with torch.no_grad():
        if init_fn is not None:
            init_fn(model)
        else:
            _reset_all(model)
    check_materialized(model)
    check_finite_weights(model, group=group)
    return model


def check_materialized(model: nn.Module) -> None:
    """Raise `MisconfigurationError` naming every parameter and buffer of `model` still on the meta device
    (DTensors by their local shard)."""
    left = [f"parameter {n}" for n, p in model.named_parameters() if _local(p).is_meta]
    left += [f"buffer {n}" for n, b in model.named_buffers() if _local(b).is_meta]
    if left:
        raise MisconfigurationError(
            f"{len(left)} tensor(s) of {type(model).__name__} are still on the meta device (shapes without "
            f"memory): {', '.join(left)}. Call materialize(model, device, init_fn) (or model.to_empty(device=...) "
            "and initialize) after building the model under torch.device('meta') and sharding it"
        )


def check_finite_weights(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Raise `MisconfigurationError` naming every parameter of `model` with a NaN or infinite value.

    Sharded parameters are checked on this rank's shard. With `group` (ranks that hold the same parameter
    names, e.g. the FSDP mesh's group) the verdicts are combined with one all-reduce, so every rank of
    the group raises together, naming every bad parameter; without it each rank judges its own shards.
    One device-to-host sync (plus that all-reduce): meant for setup, not for every step.
    """
    named = [(n, _local(p)) for n, p in model.named_parameters()]
    if not named:
        return
    with torch.no_grad():
        flags = torch.stack([_all_finite(p) for _, p in named]).to(torch.int32)
    if group is not None:
        flags = flags.to(_collective_device(group))
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    bad = [name for (name, _), ok in zip(named, flags.tolist(), strict=True) if not ok]
    if bad:
        raise MisconfigurationError(
            f"{len(bad)} parameter(s) of {type(model).__name__} hold NaN or infinite values after initialization: "
            f"{', '.join(bad)}. Check init_fn / reset_parameters for these (with meta-device builds, every "
            "parameter must be written by the initialization: to_empty leaves memory uninitialized)"
        )


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: every element of `t` is finite. Floating tensors are judged by their min and
    max (NaN propagates into both, an infinity is one of them): no temporary the size of `t`, where
    `isfinite(t).all()` allocates several (on a large shard, tens of MiB left in the allocator)."""
    if not t.numel():
        return torch.tensor(True, device=t.device)
    if t.is_floating_point():
        low, high = torch.aminmax(t)
        return torch.isfinite(low) & torch.isfinite(high)
    return torch.isfinite(t).all()


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """CPU for gloo groups, the current CUDA device for NCCL ones."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reset_all_parameters(model: nn.Module) -> None:
    """Initialize `model` with every module's own `reset_parameters()`, children before parents; a
    module that owns parameters but has no such method is an error naming it (before anything runs)."""
    _check_resettable(model)
    _reset_all(model)


def _check_resettable(model: nn.Module) -> None:
    missing = [
        f"{name or '<root>'} ({type(m).__name__}: {', '.join(n for n, _ in m.named_parameters(recurse=False))})"
        for name, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False)) and _reset_fn(m) is None
    ]
    if missing:
        raise MisconfigurationError(
            "meta-device models are initialized with each module's reset_parameters(), but these modules own "
            f"parameters and have none: {'; '.join(missing)}. Initialize them yourself (override "
            "`init_weights(self)` on the trainer, or pass init_fn= to materialize), or give those modules a "
            "reset_parameters() method"
        )


def _reset_all(model: nn.Module) -> None:
    # Children first: a parent whose reset_parameters re-initializes its children has the last word.
    for module in reversed(list(model.modules())):
        reset = _reset_fn(module)
        if reset is not None:
            reset()

"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Applied per block (each child of the model's stack of blocks) with `checkpoint_wrapper` in its
non-reentrant form, which works with FSDP2, DTensor and `torch.compile`. Apply it after tensor
parallelism and before compile and FSDP, so that FSDP units and checkpointed regions coincide.

Modes:
- "full": a block keeps only its input; its forward runs again in backward (as far as backward needs:
  non-reentrant recompute stops early). Most memory saved, about one extra forward of compute.
- "selective": per-op (torch.utils.checkpoint's selective checkpointing): the outputs of matmuls and
  attention kernels are kept, everything else in the block (activation functions, norms, elementwise
  ops) is recomputed: much of the memory saved for a small part of the recompute.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dream_trainer.errors import ConfigError

__all__ = ["AC_MODES", "SELECTIVE_SAVE_OPS", "apply_activation_checkpointing", "find_block_container"]

AC_MODES: tuple[str, ...] = ("full", "selective")


def _aten_ops(*names: str) -> list[torch._ops.OpOverloadPacket]:
    """The aten ops of these names that exist in this torch build (attention kernels vary by version)."""
    return [getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)]


#: Ops whose outputs "selective" keeps: the expensive ones (recomputing them would cost a second forward).
SELECTIVE_SAVE_OPS = _aten_ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_mm",
)
_SAVE_PACKETS = frozenset(SELECTIVE_SAVE_OPS)


def _selective_policy(ctx: object, func: torch._ops.OpOverload, *args: object, **kwargs: object) -> CheckpointPolicy:
    # Matched by packet (aten.mm), not by overload (aten.mm.default): every overload of a kept op is kept.
    if func.overloadpacket in _SAVE_PACKETS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def find_block_container(model: nn.Module) -> nn.ModuleList | nn.Sequential:
    """The model's stack of blocks: of the `nn.ModuleList` / `nn.Sequential` modules in `model` (itself
    included), the one holding the most parameters, the outermost on ties."""
    best: nn.ModuleList | nn.Sequential | None = None
    best_count = -1
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = module, count
    if best is None:
        raise ConfigError(
            f"activation checkpointing found no nn.ModuleList or nn.Sequential of blocks in {type(model).__name__}: "
            "hold the blocks in one, or pass the container to apply_activation_checkpointing(container=...)"
        )
    return best


def apply_activation_checkpointing(
    model: nn.Module, mode: str = "full", container: nn.ModuleList | nn.Sequential | None = None
) -> nn.Module:
    """Wrap every child of `container` (default: `find_block_container(model)`) that has parameters in
    a non-reentrant `checkpoint_wrapper`, in place; returns `model`.

    Idempotent: children already wrapped are left as they are (whatever their mode). Parameter names gain a
    `_checkpoint_wrapped_module.` part, which the wrapper's state-dict hooks remove again, so `state_dict()`
    keys (and checkpoints) are unchanged. A `model` that is itself a container keeps its identity.
    """
    if mode not in AC_MODES:
        valid = ", ".join(repr(m) for m in AC_MODES)
        raise ConfigError(f"activation checkpointing mode={mode!r} is invalid: valid choices are {valid}")
    if container is None:
        container = find_block_container(model)
    kwargs = {}
    if mode == "selective":
        # A fresh pair of contexts per checkpointed call, as torch.utils.checkpoint requires.
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    for name, block in list(container.named_children()):
        # Parameter-free children (activations in a Sequential) gain nothing: their input is kept anyway.
        if isinstance(block, CheckpointWrapper) or not any(True for _ in block.parameters()):
            continue
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        container.register_module(name, wrapped)
    return model

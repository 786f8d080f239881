"""Helpers for models that may be compiled or wrapped."""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any `torch.compile` / DistributedDataParallel wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and type(model).__name__ == "DistributedDataParallel":
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def has_trainable_parameters(model: nn.Module) -> bool:
    """True if any parameter of `model` requires a gradient."""
    return any(p.requires_grad for p in model.parameters())

"""Helpers for models that may be compiled or wrapped."""

from __future__ import annotations

from torch import nn

from dream_trainer.errors import MisconfigurationError


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


def pick_models(available: dict[str, nn.Module], wanted: list[str] | None, who: str, owner: str) -> list[str]:
    """The names of the models a callback works on: `wanted`, each checked to exist in `available`
    (the trainer's `named_models()`), or every model with trainable parameters. `who` names the
    callback and its argument in the error (`"EMA(models=['x'])"`), `owner` the trainer class."""
    if wanted is None:
        names = [n for n, m in available.items() if has_trainable_parameters(m)]
        if not names:
            raise MisconfigurationError(f"{who}: {owner} has no model with trainable parameters")
        return names
    missing = [n for n in wanted if n not in available]
    if missing:
        raise MisconfigurationError(f"{who}: {owner} has no model named {missing}; its models are {sorted(available)}")
    return list(wanted)

"""Helpers for nested structures of tensors (batches, outputs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_nested_tensor(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply `fn` to every tensor in a nest of dicts, lists, tuples and namedtuples; keep the rest."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: map_nested_tensor(fn, v) for k, v in data.items()})  # type: ignore[call-arg]  # mapping types rebuilt from a dict
    if isinstance(data, tuple):
        items = [map_nested_tensor(fn, v) for v in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, list):
        return [map_nested_tensor(fn, v) for v in data]
    return data


def move_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in `data` to `device` (objects with their own `.to` are moved too)."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, (Mapping, tuple, list)):
        return map_nested_tensor(lambda t: t.to(device, non_blocking=non_blocking), data)
    to = getattr(data, "to", None)
    if callable(to):
        return to(device)
    return data


def batch_size_of(batch: Any) -> int:
    """Length of the first dimension of the first tensor found in `batch` (1 if there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size != 1 or isinstance(item, torch.Tensor):
                return size
    return 1


def fingerprint(data: Any) -> str:
    """A short digest of a (nested) batch's tensors and plain values, equal for equal batches (to compare
    batches across processes without sending them)."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, Mapping):
            for key in sorted(x, key=str):
                digest.update(str(key).encode())
                visit(x[key])
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        else:
            digest.update(repr(x).encode())

    visit(data)
    return digest.hexdigest()

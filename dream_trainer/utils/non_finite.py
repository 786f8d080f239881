"""Non-finite values: the weights check a checkpoint save runs, and the settings every message names."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

SETTINGS_HELP = (
    'non_finite_loss="raise" (the default) checks the training loss at each logging point, at no '
    'extra cost; "warn" reports and trains on; "ignore" turns the check off. To stop at the very '
    'first bad step set non_finite_grads="raise"; to drop bad steps "skip", to re-run the batch '
    '"retry" (these check the gradients at every step: one device sync per step).'
)

_CHUNK = 1 << 24  # elements per isfinite() call: bounds the temporary bool tensor to 16 MB


def modules_are_finite(modules: Iterable[nn.Module]) -> bool:
    """True when every floating-point parameter and buffer of `modules` is finite (this rank's shard
    of a sharded tensor). SYNC: one device-to-host read per device; called at checkpoint saves only."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if id(t) in seen or not (t.is_floating_point() or t.is_complex()):
                continue
            seen.add(id(t))
            local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
            if local.is_meta or local.numel() == 0:
                continue
            flat = local.detach().reshape(-1)
            for chunk in flat.split(_CHUNK):
                flags.setdefault(chunk.device, []).append(torch.isfinite(chunk).all())
    return all(bool(torch.stack(found).all()) for found in flags.values())


def weights_are_finite(modules: Iterable[nn.Module], all_reduce: Callable[..., Any] | None = None) -> bool:
    """`modules_are_finite` on every rank: with `all_reduce` (the trainer's, collective: every rank
    calls it at the same point, as every rank takes part in a save) one rank's bad shard counts for all."""
    local = modules_are_finite(modules)
    if all_reduce is None:
        return local
    flag = torch.tensor([0.0 if local else 1.0])
    all_reduce(flag, "max")
    return not bool(flag.item())


def non_finite_losses(values: Mapping[str, float]) -> dict[str, float]:
    """The entries of `values` whose name ends in "loss" ("loss", "g_loss", "train/loss", ...) and whose
    value is NaN or infinite."""
    return {k: v for k, v in values.items() if k.endswith("loss") and not math.isfinite(v)}

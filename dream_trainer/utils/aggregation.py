"""Metric aggregation that never syncs the device until the values are read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class MetricAggregator:
    """Weighted running means of scalar metrics.

    `update()` only appends detached tensors (or floats) to lists: no kernel, no sync, no allocation
    beyond the list slot. `compute()` stacks each list once and reads all values back with a single
    device-to-host copy; the sums are then folded into float totals so memory stays bounded.
    """

    def __init__(self) -> None:
        self._pending: dict[str, list[Any]] = {}
        self._weights: dict[str, list[float]] = {}
        self._totals: dict[str, float] = {}
        self._total_weights: dict[str, float] = {}

    def update(self, metrics: Mapping[str, Any], weight: float = 1.0) -> None:
        """Record one value per metric; non-scalar entries (logits, images, ...) are ignored."""
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.detach()
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = [value]
                self._weights[key] = [weight]
            else:
                pending.append(value)
                self._weights[key].append(weight)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def compute(self) -> dict[str, float]:
        """Weighted means of what was recorded since the last `compute()`, and fold them into totals.

        SYNC: one device-to-host copy for all metrics together.
        """
        if not self._pending:
            return {}
        keys = list(self._pending)
        device = next(
            (v.device for vals in self._pending.values() for v in vals if isinstance(v, torch.Tensor)),
            torch.device("cpu"),
        )
        sums = []
        for key in keys:
            values = [
                v.to(device=device, dtype=torch.float64).reshape(())
                if isinstance(v, torch.Tensor)
                else torch.tensor(float(v), dtype=torch.float64, device=device)
                for v in self._pending[key]
            ]
            w = torch.tensor(self._weights[key], dtype=torch.float64, device=device)
            sums.append((torch.stack(values) * w).sum())
        host = torch.stack(sums).tolist()
        out: dict[str, float] = {}
        for key, total in zip(keys, host, strict=True):
            weight = float(sum(self._weights[key]))
            out[key] = total / weight
            self._totals[key] = self._totals.get(key, 0.0) + total
            self._total_weights[key] = self._total_weights.get(key, 0.0) + weight
        self._pending.clear()
        self._weights.clear()
        return out

    def totals(self) -> dict[str, float]:
        """Weighted means over everything recorded since the last `reset()` (computes pending first)."""
        self.compute()
        return {k: self._totals[k] / self._total_weights[k] for k in self._totals if self._total_weights[k]}

    def reset(self) -> None:
        """Forget everything."""
        self._pending.clear()
        self._weights.clear()
        self._totals.clear()
        self._total_weights.clear()

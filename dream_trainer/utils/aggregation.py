"""Metric aggregation that never syncs the device until the values are read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class MetricAggregator:
    """Weighted running means of scalar metrics.

    `update()` only appends to lists: detached tensors on an accelerator (no kernel, no sync), plain
    floats for CPU tensors and numbers. `compute()` stacks each list of tensors once and reads all
    values back with a single device-to-host copy; the sums are then folded into float totals so
    memory stays bounded.
    """

    def __init__(self) -> None:
        self._pending: dict[str, list[Any]] = {}
        self._weights: dict[str, list[float]] = {}
        self._totals: dict[str, float] = {}
        self._total_weights: dict[str, float] = {}
        # About the pending values, so that `compute()` need not look at each of them again.
        self._tensors = False  # some are tensors (not yet read back); else all are numbers
        self._weighted = False  # some weight is not 1.0
        self._weighted_keys: set[str] = set()
        """Metrics recorded with a weight other than 1.0 since the last `reset()` (see `merged_state`)."""
        # Set by the trainer when distributed: sums a 1-D float64 tensor across ranks in place.
        self.reducer: Any = None
        self.key_union: Any = None  # with reducer: the sorted union of every rank's metric names

    def update(self, metrics: Mapping[str, Any], weight: float = 1.0) -> None:
        """Record one value per metric; non-scalar entries (logits, images, ...) are ignored."""
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = _keep(value)
                if isinstance(value, torch.Tensor):
                    self._tensors = True
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if weight != 1.0:
                self._weighted = True
                self._weighted_keys.add(key)
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = [value]
                self._weights[key] = [weight]
            else:
                pending.append(value)
                self._weights[key].append(weight)

    def add(self, key: str, value: torch.Tensor) -> None:
        """Fast path for one scalar tensor with weight 1 (a bare loss returned from a step)."""
        if EAGER_CPU_READS and value.is_cpu:  # `_keep`, inlined: this runs every step
            kept: Any = value.item()
        else:
            kept = value.detach()
            self._tensors = True
        pending = self._pending.get(key)
        if pending is None:
            self._pending[key] = [kept]
            self._weights[key] = [1.0]
        else:
            pending.append(kept)
            self._weights[key].append(1.0)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def compute(self) -> dict[str, float]:
        """Weighted means of what was recorded since the last `compute()`, and fold them into totals.

        SYNC: one device-to-host copy for all metrics together.
        """
        if self.reducer is None and not self._pending:
            return {}
        keys = list(self._pending)
        if self.reducer is not None:
            # Every rank reduces the same keys in the same order, also a rank that logged nothing.
            keys = self.key_union(sorted(keys))
            if not keys:
                return {}
            for key in keys:
                if key not in self._pending:
                    self._pending[key], self._weights[key] = [0.0], [0.0]
        if not self._tensors:  # numbers only (CPU values are read when recorded): no device, no kernel
            host: list[Any] = [self._float_sum(key) for key in keys]
            return self._reduce_and_fold(keys, host)
        device = next(
            (v.device for vals in self._pending.values() for v in vals if isinstance(v, torch.Tensor)),
            torch.device("cpu"),
        )
        if self.reducer is None and all(
            len(vals) == 1 and isinstance(vals[0], torch.Tensor) for vals in self._pending.values()
        ):
            return self._compute_single_values(keys)
        sums: list[Any] = []
        for key in keys:
            pending, weights_k = self._pending[key], self._weights[key]
            if not any(isinstance(v, torch.Tensor) for v in pending):  # this metric's values are numbers
                sums.append(self._float_sum(key))
                continue
            if all(isinstance(v, torch.Tensor) for v in pending):
                stacked = torch.stack([v.reshape(()) for v in pending]).to(device=device, dtype=torch.float64)
            else:
                stacked = torch.tensor(
                    [float(v) if not isinstance(v, torch.Tensor) else float("nan") for v in pending],
                    dtype=torch.float64,
                    device=device,
                )
                for i, v in enumerate(pending):  # mixed floats and tensors: rare, keep it simple
                    if isinstance(v, torch.Tensor):
                        stacked[i] = v.to(device=device, dtype=torch.float64).reshape(())
            if all(w == 1.0 for w in weights_k):  # the usual training case: a plain sum
                sums.append(stacked.sum())
            else:
                sums.append((stacked * torch.tensor(weights_k, dtype=torch.float64, device=device)).sum())
        if any(isinstance(s, torch.Tensor) for s in sums):
            # SYNC: the one device-to-host copy of this logging point.
            on_device = torch.stack([torch.as_tensor(s, dtype=torch.float64, device=device) for s in sums])
            host = on_device.tolist()
        else:
            host = sums
        return self._reduce_and_fold(keys, host)

    def _float_sum(self, key: str) -> float:
        """The weighted sum of `key`'s pending values, all numbers."""
        pending, weights = self._pending[key], self._weights[key]
        if not self._weighted or all(w == 1.0 for w in weights):
            return float(sum(pending))
        return float(sum(v * w for v, w in zip(pending, weights, strict=True)))

    def _reduce_and_fold(self, keys: list[str], host: list[float]) -> dict[str, float]:
        """`host`: each key's weighted sum, read back. Distributed: summed over the ranks with the weights in
        one collective. Then folded into the totals."""
        weights = [float(sum(self._weights[key])) for key in keys]
        if self.reducer is not None:
            # One collective for all metrics: every rank's sums and weights, added up.
            packed = torch.tensor(host + weights, dtype=torch.float64)
            self.reducer(packed)  # on the CPU: every rank uses the same (gloo) backend for it
            host_all = packed.tolist()
            host, weights = host_all[: len(keys)], host_all[len(keys) :]
        return self._fold(keys, host, weights)

    def _compute_single_values(self, keys: list[str]) -> dict[str, float]:
        # Logging every step: each metric has one value. One read for all of them (a plain `.item()`
        # for the usual single loss) instead of the stack/convert/sum kernels per metric.
        values = [self._pending[key][0] for key in keys]
        if len(values) == 1:
            host = [values[0].item()]  # SYNC: the one read-back of this logging point
        else:
            host = torch.stack([v.reshape(()).to(torch.float64) for v in values]).tolist()  # SYNC
        weights = [self._weights[key][0] for key in keys]
        return self._fold(keys, [v * w for v, w in zip(host, weights, strict=True)], weights)

    def _fold(self, keys: list[str], totals: list[float], weights: list[float]) -> dict[str, float]:
        """Add the interval's weighted sums to the running totals; clear it; return its means."""
        out: dict[str, float] = {}
        for key, total, weight in zip(keys, totals, weights, strict=True):
            if not weight:
                continue
            out[key] = total / weight
            self._totals[key] = self._totals.get(key, 0.0) + total
            self._total_weights[key] = self._total_weights.get(key, 0.0) + weight
        self._pending.clear()
        self._weights.clear()
        self._tensors = self._weighted = False
        return out

    def names(self) -> set[str]:
        """Every name recorded since the last `reset()`, pending or folded (nothing is read back)."""
        return {*self._pending, *self._totals}

    def totals(self) -> dict[str, float]:
        """Weighted means over everything recorded since the last `reset()` (computes pending first)."""
        self.compute()
        return {k: self._totals[k] / self._total_weights[k] for k in self._totals if self._total_weights[k]}

    def state_dict(self) -> dict[str, Any]:
        """What was recorded, as plain floats: for checkpoints. SYNC: reads the pending values back."""
        pending = {key: {"values": [float(v) for v in values], "weights": list(self._weights[key])}
                   for key, values in self._pending.items()}  # fmt: skip
        return {
            "pending": pending,
            "totals": dict(self._totals),
            "total_weights": dict(self._total_weights),
            "weighted": sorted(self._weighted_keys),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict()`: the next `compute()` includes the values recorded before it."""
        self.reset()
        for key, entry in state.get("pending", {}).items():
            # Floats, not tensors: they join values on whatever device the resumed run uses.
            self._pending[key] = list(entry["values"])
            self._weights[key] = list(entry["weights"])
            self._weighted = self._weighted or any(w != 1.0 for w in entry["weights"])
        self._totals.update(state.get("totals", {}))
        self._total_weights.update(state.get("total_weights", {}))
        self._weighted_keys.update(state.get("weighted", ()))

    def reset(self) -> None:
        """Forget everything."""
        self._pending.clear()
        self._weights.clear()
        self._tensors = self._weighted = False
        self._totals.clear()
        self._total_weights.clear()
        self._weighted_keys.clear()


def merged_state(states: list[Mapping[str, Any]], scale: float = 1.0) -> dict[str, Any]:
    """One `MetricAggregator.state_dict()` holding what the states of all the ranks of a run hold together,
    for the rank that continues their epoch on another number of ranks (rank 0; the others continue none):
    their pending values (rank after rank; not yet added up over the ranks) and the totals (added up over
    the ranks at each logging point already, so the same on every rank: the first's).

    `scale`: values recorded per step now over values per step then (ranks x micro-batches, each side).
    A metric recorded with weight 1 (a returned loss) counts once per rank and micro-batch, so its steps
    before the resume weigh `scale` times as much each, as many values as a step records now: the epoch's
    mean is the uninterrupted run's. A metric logged with weights (`batch_size`) keeps them: a step's
    weights add up to its samples, which a resume keeps."""
    pending: dict[str, dict[str, list[float]]] = {}
    weighted: set[str] = set()
    for state in states:
        weighted.update(state.get("weighted", ()))
        for key, entry in state.get("pending", {}).items():
            merged = pending.setdefault(key, {"values": [], "weights": []})
            merged["values"] += list(entry["values"])
            merged["weights"] += list(entry["weights"])
            if any(w != 1.0 for w in entry["weights"]):
                weighted.add(key)
    first = states[0] if states else {}
    totals, total_weights = dict(first.get("totals", {})), dict(first.get("total_weights", {}))
    if scale != 1.0:
        for key in {*pending, *totals} - weighted:
            if key in pending:
                pending[key]["weights"] = [w * scale for w in pending[key]["weights"]]
            if key in totals:
                totals[key] *= scale
                total_weights[key] *= scale
        weighted.update({*pending, *totals})
    return {"pending": pending, "totals": totals, "total_weights": total_weights, "weighted": sorted(weighted)}


# Read CPU scalars at once (see `_keep`). The tests turn it off to check, with CPU tensors, the path
# every accelerator tensor takes: no read until `compute()`.
EAGER_CPU_READS = True


def _keep(value: torch.Tensor) -> Any:
    """What a pending list holds for a scalar tensor: its float when it is on the CPU (no device to
    wait for, and keeping thousands of tiny tensors alive costs the allocator more than reading
    them: 7 us of a 120 us tiny-MLP step), else the detached tensor, read at the next `compute()`."""
    return value.item() if EAGER_CPU_READS and value.is_cpu else value.detach()

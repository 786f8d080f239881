"""MetricsMixin: torchmetrics `Metric`/`MetricCollection` attributes, computed once per epoch.

Assign metrics to the trainer (`self.val_accuracy = MulticlassAccuracy(num_classes=10)`) and call
them in your steps (`self.val_accuracy(logits, y)`); the trainer moves them to the device, resets
them when their phase starts, and computes and logs them when it ends. Attributes whose names start
with `train` belong to the training epoch, `test` to `trainer.test()`, all others to validation.
A metric logged Lightning-style with `self.log("val_acc", self.accuracy)` is logged under that name
instead of its attribute name.
Distributed synchronisation is torchmetrics' own (inside `compute()`).
"""

from __future__ import annotations

from typing import Any

import torch

from dream_trainer.mixins.core import is_torchmetric
from dream_trainer.mixins.distributed import DistributedMixin

__all__ = ["MetricsMixin", "is_torchmetric", "load_metric_state", "metric_state"]


def _updated(metric: Any) -> bool:
    if hasattr(metric, "update_count"):
        return bool(metric.update_count)
    return any(_updated(m) for m in metric.values())  # MetricCollection


def _leaves(metric: Any) -> list[tuple[str, Any]]:
    """`(name, Metric)` of a Metric, or of each member of a MetricCollection."""
    if hasattr(metric, "_defaults"):
        return [("", metric)]
    return [(name, m) for name, m in metric.items(keep_base=True, copy_state=False)]


def _to(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    return [_to(v, device) for v in value]  # list states ("cat" metrics)


def metric_state(metric: Any) -> dict[str, Any]:
    """The accumulated state of a torchmetrics Metric/MetricCollection, on the CPU (for checkpoints)."""
    return {
        name: {"states": {k: _to(getattr(m, k), "cpu") for k in m._defaults}, "update_count": m._update_count}
        for name, m in _leaves(metric)
    }


def load_metric_state(metric: Any, state: dict[str, Any]) -> None:
    """Put `metric_state()`'s values back, on the metric's device: `compute()` continues from them."""
    for name, m in _leaves(metric):
        if name not in state:
            continue
        for k, value in state[name]["states"].items():
            setattr(m, k, _to(value, m.device))
        m._update_count = state[name]["update_count"]
        m._computed = None


class MetricsMixin(DistributedMixin):
    """Discovers, places, resets and computes torchmetrics objects."""

    def _init_metrics(self) -> None:
        # phase -> {log name: metric}; filled at setup from attributes and by `self.log(name, metric)`
        self._phase_metrics: dict[str, dict[str, Any]] = {"train": {}, "val": {}, "test": {}}

    def named_metrics(self) -> list[tuple[str, Any]]:
        """`(attribute name, metric)` for every torchmetrics Metric/MetricCollection on the trainer."""
        return [(k, v) for k, v in vars(self).items() if not k.startswith("_") and is_torchmetric(v)]

    def _setup_metrics(self) -> None:
        for name, metric in self.named_metrics():
            metric.to(self.device)
            aliased = any(m is metric for ms in self._phase_metrics.values() for m in ms.values())
            if not aliased:
                phase = "train" if name.startswith("train") else "test" if name.startswith("test") else "val"
                self._phase_metrics[phase][name] = metric

    def _log_metric_object(self, name: str, metric: Any, phase: str) -> None:
        """`self.log(name, metric)`: compute `metric` at the end of `phase`, logged as `name`."""
        for ms in self._phase_metrics.values():
            for key in [k for k, m in ms.items() if m is metric and k != name]:
                del ms[key]  # logged under the user's name, not the attribute's
        self._phase_metrics[phase][name] = metric

    def _reset_metrics(self, phase: str) -> None:
        for metric in self._phase_metrics[phase].values():
            metric.reset()

    def _train_metrics_state(self) -> dict[str, Any]:
        """The training torchmetrics' accumulated states, by log name (what a mid-epoch resume needs)."""
        return {name: metric_state(m) for name, m in self._phase_metrics["train"].items()}

    def _load_train_metrics_state(self, state: dict[str, Any]) -> None:
        for name, metric in self._phase_metrics["train"].items():
            if name in state:
                load_metric_state(metric, state[name])

    def _compute_metrics(self, phase: str) -> dict[str, float]:
        """Compute the metrics of `phase` that were updated. SYNC: one read-back for all of them."""
        names: list[str] = []
        values: list[torch.Tensor] = []
        for name, metric in self._phase_metrics[phase].items():
            if not _updated(metric):
                continue
            result = metric.compute()
            items = result.items() if isinstance(result, dict) else [(name, result)]
            for key, value in items:
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    names.append(key)
                    values.append(value.detach().to(torch.float64).reshape(()).cpu())
        if not values:
            return {}
        return dict(zip(names, torch.stack(values).tolist(), strict=True))

"""Averaging nested records (dicts of metrics)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["key_average"]


def _is_numeric(value: Any) -> bool:
    # bool is an int subclass, but a flag is not a metric (MetricAggregator skips it too).
    if isinstance(value, torch.Tensor):
        return value.dtype != torch.bool and not value.is_complex()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def key_average(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Average the numeric values of a list of nested dicts, key by key.

    ```python
    key_average([{"loss": 0.5, "metrics": {"acc": 0.9}}, {"loss": 0.6, "metrics": {"acc": 0.85}}])
    # -> {"loss": 0.55, "metrics": {"acc": 0.875}}
    ```

    - Nested dicts are averaged recursively; keys keep the order in which they are first seen.
    - A key missing from some records is averaged over the records that have it.
    - Numbers (int, float, NumPy scalars) give a float. Tensors give a tensor on their own device (an
      element-wise mean for tensors of the same shape; integer tensors become floating point), so
      averaging device tensors never waits for the device. Tensors and numbers may be mixed.
    - Other values (strings, None, booleans, lists) are not metrics and are left out.

    Raises `TypeError` when a key holds a dict in one record and a value in another.
    """
    if isinstance(records, Mapping):
        raise TypeError("key_average(records) takes a list of dicts, not a single dict; wrap it: [record]")
    values: dict[str, list[Any]] = {}
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"key_average: records[{i}] is a {type(record).__name__}, expected a dict")
        for key, value in record.items():
            values.setdefault(key, []).append(value)
    out: dict[str, Any] = {}
    for key, vals in values.items():
        nested = [isinstance(v, Mapping) for v in vals]
        if any(nested):
            if not all(nested):
                raise TypeError(f"key_average: {key!r} is a dict in some records and a plain value in others")
            sub = key_average(vals)
            if sub:
                out[key] = sub
            continue
        numeric = [v for v in vals if _is_numeric(v)]
        if not numeric:
            continue
        total = numeric[0] if isinstance(numeric[0], torch.Tensor) else float(numeric[0])
        for v in numeric[1:]:
            total = total + v
        out[key] = total / len(numeric)
    return out

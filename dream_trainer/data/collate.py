"""`PadCollator`: batches samples of different lengths by padding their tensors to the longest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["PadCollator"]


class PadCollator:
    """A `collate_fn` that pads tensors to the longest in the batch and gathers everything else in lists.

    Samples are dicts (nested dicts are collated key by key), tuples/lists (collated position by
    position) or single tensors. Tensors of one field are padded, at the end of every dimension, to the
    batch's largest size in that dimension and stacked; other values (strings, numbers, ids) come out as
    a list with one entry per sample.

    ```python
    collate = PadCollator(pad_value=0, pad_values={"labels": -100})
    batch = collate([{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, 8]), "text": "abc"},
                     {"input_ids": torch.tensor([9]), "labels": torch.tensor([1]), "text": "d"}])
    # batch["input_ids"] == [[5, 6, 7], [9, 0, 0]], batch["labels"] == [[6, 7, 8], [1, -100, -100]],
    # batch["text"] == ["abc", "d"]
    ```

    Args:
        pad_value: what pads every tensor, unless `pad_values` names its field.
        pad_values: pad values by field name (the key in its dict, at any depth), e.g. `{"labels": -100}`.
        padding_side: `"right"` pads after the data of the first dimension (the sequence), `"left"`
            before it (decoder-only generation); other dimensions are padded at the end.
        pad_to_multiple_of: round the padded length of the first dimension up to a multiple of it.
    """

    def __init__(
        self,
        pad_value: float = 0,
        pad_values: Mapping[str, float] | None = None,
        padding_side: str = "right",
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if padding_side not in ("right", "left"):
            raise ValueError(f"PadCollator: padding_side={padding_side!r} is not valid; use 'right' or 'left'")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"PadCollator: pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_value = pad_value
        self.pad_values = dict(pad_values or {})
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[Any]) -> Any:
        if not samples:
            raise ValueError("PadCollator: the batch is empty")
        return self._collate(list(samples), self.pad_value, "batch")

    def _collate(self, values: list[Any], pad: float, where: str) -> Any:
        first = values[0]
        if isinstance(first, torch.Tensor):
            if not all(isinstance(v, torch.Tensor) for v in values):
                raise TypeError(f"PadCollator: {where} is a tensor in some samples and not in others")
            return self._pad(values, pad, where)
        if isinstance(first, Mapping):
            keys = list(first)
            for i, v in enumerate(values):
                if not isinstance(v, Mapping) or set(v) != set(keys):
                    raise ValueError(
                        f"PadCollator: sample {i} of {where} has keys {sorted(v) if isinstance(v, Mapping) else v!r}, "
                        f"sample 0 has {sorted(keys)}; every sample needs the same fields"
                    )
            return {
                k: self._collate([v[k] for v in values], self.pad_values.get(k, pad), f"{where}[{k!r}]") for k in keys
            }
        if isinstance(first, tuple | list) and not isinstance(first, str):
            if any(not isinstance(v, tuple | list) or len(v) != len(first) for v in values):
                raise ValueError(f"PadCollator: the samples of {where} are sequences of different lengths")
            return type(first)(self._collate([v[j] for v in values], pad, f"{where}[{j}]") for j in range(len(first)))
        return values

    def _pad(self, tensors: list[torch.Tensor], pad: float, where: str) -> torch.Tensor:
        ndim = tensors[0].dim()
        if any(t.dim() != ndim for t in tensors):
            raise ValueError(
                f"PadCollator: the tensors of {where} have different numbers of dimensions "
                f"({sorted({t.dim() for t in tensors})}); only sizes may differ"
            )
        if ndim == 0:
            return torch.stack(tensors)
        shape = [max(t.shape[d] for t in tensors) for d in range(ndim)]
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            shape[0] = -(-shape[0] // m) * m
        if all(list(t.shape) == shape for t in tensors):
            return torch.stack(tensors)
        out = tensors[0].new_full((len(tensors), *shape), pad)
        left = self.padding_side == "left"
        for i, t in enumerate(tensors):
            first = slice(shape[0] - t.shape[0], shape[0]) if left else slice(0, t.shape[0])
            region: tuple[int | slice, ...] = (i, first, *(slice(0, s) for s in t.shape[1:]))
            out[region] = t
        return out

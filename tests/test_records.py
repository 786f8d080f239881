"""key_average: seed 002's averaging of nested metric records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dream_trainer.utils.records import key_average


def test_seed_example_averages_nested_dicts():
    records = [{"loss": 0.5, "metrics": {"acc": 0.9}}, {"loss": 0.6, "metrics": {"acc": 0.85}}]
    avg = key_average(records)
    assert avg == {"loss": pytest.approx(0.55), "metrics": {"acc": pytest.approx(0.875)}}
    assert list(avg) == ["loss", "metrics"]
    # the input is not modified
    assert records == [{"loss": 0.5, "metrics": {"acc": 0.9}}, {"loss": 0.6, "metrics": {"acc": 0.85}}]


def test_missing_keys_average_over_the_records_that_have_them():
    avg = key_average([{"a": 1.0, "b": {"c": 2}}, {"a": 3.0}, {"b": {"c": 4, "d": 10}}])
    assert avg == {"a": 2.0, "b": {"c": 3.0, "d": 10.0}}
    assert isinstance(avg["b"]["c"], float)


def test_tensors_stay_tensors_and_mix_with_numbers():
    avg = key_average([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}, {"loss": 6.0}])
    assert isinstance(avg["loss"], torch.Tensor)
    assert avg["loss"].item() == pytest.approx(3.0)
    vec = key_average([{"v": torch.tensor([1.0, 2.0])}, {"v": torch.tensor([3.0, 6.0])}])["v"]
    assert torch.equal(vec, torch.tensor([2.0, 4.0]))
    counts = key_average([{"n": torch.tensor(1)}, {"n": torch.tensor(2)}])["n"]
    assert counts.is_floating_point() and counts.item() == pytest.approx(1.5)
    assert key_average([{"x": np.float32(1.0)}, {"x": 2}])["x"] == pytest.approx(1.5)


def test_non_numeric_values_are_left_out():
    avg = key_average([{"loss": 1.0, "tag": "a", "flag": True, "none": None}, {"loss": 2.0, "tag": "b"}])
    assert avg == {"loss": 1.5}
    assert key_average([{"sub": {"name": "x"}}]) == {}


def test_empty_and_invalid_inputs():
    assert key_average([]) == {}
    with pytest.raises(TypeError, match="'m' is a dict in some records"):
        key_average([{"m": {"acc": 1.0}}, {"m": 0.5}])
    with pytest.raises(TypeError, match="list of dicts"):
        key_average({"loss": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"records\[1\]"):
        key_average([{"loss": 1.0}, 3.0])  # type: ignore[list-item]

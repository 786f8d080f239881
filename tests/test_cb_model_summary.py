"""ModelSummary: exact parameter counts per module and in total, and the table printed at fit start."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from torch import nn

from dream_trainer import ConfigError
from dream_trainer.callbacks.model_summary import ModelSummary


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))  # 40 + 72 = 112
        self.norm = nn.BatchNorm1d(8)  # 16 params, buffers: 8 + 8 floats + 1 int64
        self.head = nn.Linear(8, 1)  # 9

    def forward(self, x):
        return self.head(self.norm(self.encoder(x)))


class SummaryTrainer(TinyTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.model = Net()
        self.teacher = nn.Linear(4, 2)  # 10, frozen
        self.teacher.requires_grad_(False)


NET_PARAMS = 112 + 16 + 9  # 137
TOTAL = NET_PARAMS + 10  # 147
# size: float32 params and buffers, plus BatchNorm's int64 counter
TOTAL_BYTES = (TOTAL + 16) * 4 + 8


def trainer_with(tmp_path, cb):
    return SummaryTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[cb]))


def test_summarize_counts_parameters_exactly(tmp_path):
    rows = ModelSummary(max_depth=1).summarize(trainer_with(tmp_path, ModelSummary()))
    by_name = {r["name"]: r for r in rows}
    assert list(by_name) == ["model", "model.encoder", "model.norm", "model.head", "teacher"]
    assert by_name["model"] == {
        "model": "model",
        "name": "model",
        "type": "Net",
        "depth": 0,
        "params": NET_PARAMS,
        "trainable_params": NET_PARAMS,
        "size_mb": pytest.approx((NET_PARAMS + 16) * 4e-6 + 8e-6),
    }
    assert (by_name["model.encoder"]["params"], by_name["model.encoder"]["type"]) == (112, "Sequential")
    assert by_name["model.norm"]["params"] == 16
    assert by_name["model.head"]["depth"] == 1
    assert (by_name["teacher"]["params"], by_name["teacher"]["trainable_params"]) == (10, 0)


def test_max_depth_controls_the_rows(tmp_path):
    trainer = trainer_with(tmp_path, ModelSummary())
    assert [r["name"] for r in ModelSummary(max_depth=0).summarize(trainer)] == ["model", "teacher"]
    deep = [r["name"] for r in ModelSummary(max_depth=-1).summarize(trainer)]
    assert "model.encoder.2" in deep and len(deep) == 1 + 3 + 3 + 1
    assert {r["name"]: r["params"] for r in ModelSummary(max_depth=2).summarize(trainer)}["model.encoder.2"] == 72


def test_totals_count_shared_parameters_once(tmp_path):
    trainer = trainer_with(tmp_path, ModelSummary())
    t = ModelSummary.totals(trainer)
    assert t == {
        "params": TOTAL,
        "trainable_params": NET_PARAMS,
        "non_trainable_params": 10,
        "size_mb": pytest.approx(TOTAL_BYTES / 1e6),
    }
    trainer.head_alias = trainer.model.head  # the same module under two names: counted once in totals
    assert ModelSummary.totals(trainer)["params"] == TOTAL
    assert len(ModelSummary().summarize(trainer)) == 6


def test_prints_the_table_and_totals_at_fit_start(tmp_path, capsys):
    trainer = trainer_with(tmp_path, ModelSummary(max_depth=1))
    trainer.fit()
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # captured output: no colour codes
    for text in ("Model summary", "model.encoder", "Sequential", "BatchNorm1d", "teacher", "112"):
        assert text in out
    lines = out.splitlines()
    assert f"Trainable params: {NET_PARAMS}" in lines
    assert "Non-trainable params: 10" in lines
    assert f"Total params: {TOTAL}" in lines
    assert f"Total size (MB): {TOTAL_BYTES / 1e6:.3f}" in lines
    # printed once, before training (the first line of output is the table)
    assert out.count("Total params:") == 1 and out.index("Model summary") < out.index("Total params")


def test_wide_numbers_and_long_names_are_not_cut(tmp_path):
    class Big(TinyTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.a_rather_long_model_attribute_name = nn.Sequential(nn.Embedding(100_000, 64))

    buf = io.StringIO()
    ModelSummary(max_depth=1).render(Big(quiet_config(tmp_path)), file=buf)
    out = buf.getvalue()
    assert "a_rather_long_model_attribute_name.0" in out and "6,400,000" in out
    assert "Total params: 6,400,005" in out.splitlines()


def test_only_rank_zero_prints_and_bad_depth(tmp_path, capsys, monkeypatch):
    trainer = trainer_with(tmp_path, ModelSummary())
    monkeypatch.setattr(type(trainer), "is_global_zero", property(lambda self: False), raising=False)
    ModelSummary().on_fit_start(trainer)
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match=r"ModelSummary\(max_depth=-2\)"):
        ModelSummary(max_depth=-2)


def test_lazy_modules_count_as_zero_until_initialized(tmp_path):
    trainer = trainer_with(tmp_path, ModelSummary())
    trainer.lazy = nn.LazyLinear(3)
    rows = {r["name"]: r for r in ModelSummary().summarize(trainer)}
    assert rows["lazy"]["params"] == 0
    trainer.lazy(torch.zeros(2, 5))
    assert {r["name"]: r for r in ModelSummary().summarize(trainer)}["lazy"]["params"] == 18

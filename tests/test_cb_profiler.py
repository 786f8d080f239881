"""Profiler: a TensorBoard trace with the model's ops after a short run; stopped on every exit path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config

from dream_trainer import ConfigError
from dream_trainer.callbacks.profiler import Profiler


def traces(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.pt.trace.json"))


def op_names(trace: Path) -> set[str]:
    return {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}


def test_writes_a_tensorboard_trace_with_the_models_ops(tmp_path):
    cb = Profiler(wait=1, warmup=1, active=2)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[cb]))  # 8 steps
    trainer.fit()
    directory = trainer.log_dir / "profiler"
    assert cb.trace_dir == directory and directory.is_relative_to(tmp_path)
    [trace] = traces(directory)  # one cycle: one file
    names = op_names(trace)
    assert {"aten::linear", "aten::addmm"} & names  # the model's forward
    assert "aten::mse_loss" in names
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names  # the two active steps, after wait + warmup
    assert "ProfilerStep#4" not in names
    assert cb.profiler is None  # stopped once the schedule was done
    assert not torch.autograd.profiler._is_profiler_enabled


def test_repeat_and_dirpath(tmp_path):
    cb = Profiler(wait=0, warmup=1, active=1, repeat=2, dirpath=tmp_path / "prof", record_shapes=True)
    TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[cb])).fit()
    assert len(traces(tmp_path / "prof")) == 2


def test_stopped_and_written_when_training_fails(tmp_path):
    class Failing(TinyTrainer):
        def training_step(self, batch, batch_idx):
            if self.global_step == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    cb = Profiler(wait=1, warmup=1, active=5)
    trainer = Failing(quiet_config(tmp_path, n_epochs=2, callbacks=[cb]))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert cb.profiler is None
    assert not torch.autograd.profiler._is_profiler_enabled
    [trace] = traces(trainer.log_dir / "profiler")  # the partial cycle was written
    assert "ProfilerStep#2" in op_names(trace)


def test_stopped_when_training_ends_before_the_schedule(tmp_path):
    cb = Profiler(wait=1, warmup=1, active=10)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[cb]))
    trainer.fit()  # 4 steps
    assert cb.profiler is None and not torch.autograd.profiler._is_profiler_enabled
    assert len(traces(trainer.log_dir / "profiler")) == 1


def test_bad_schedule():
    for kwargs, arg in [({"active": 0}, "active"), ({"wait": -1}, "wait"), ({"repeat": 1.5}, "repeat")]:
        with pytest.raises(ConfigError, match=rf"Profiler\({arg}="):
            Profiler(**kwargs)

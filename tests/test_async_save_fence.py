"""An asynchronous save copies the optimizers' per-parameter state on the writer thread; the next
optimizer step waits for that copy, so the file holds the state at save time and training is unchanged."""

from __future__ import annotations

import threading
import time

import torch
from conftest import quiet_config
from helpers import ckpt_dir
from test_checkpoint_write import TwoGroups

import dream_trainer.mixins.checkpoint as ckpt_mixin
from dream_trainer import Callback, ModelCheckpoint
from dream_trainer.utils.checkpoint_io import read_checkpoint


class _RecordAtSave(Callback):
    """Clones the optimizer state the moment the checkpoint state is built."""

    def __init__(self) -> None:
        self.at_save: dict[int, dict] = {}

    def on_save_checkpoint(self, trainer, checkpoint) -> None:
        state = checkpoint["optimizers"]["optimizer"]["state"]  # live tensors, about to be written
        self.at_save[trainer.global_step] = {n: {k: v.clone() for k, v in e.items()} for n, e in state.items()}


def _slow_copies_in_the_writer(monkeypatch, delay: float = 0.3) -> list[float]:
    """The writer thread's copies take `delay` longer; returns when each of them ended."""
    real = ckpt_mixin.detached_cpu_copy
    ended: list[float] = []

    def copy(state, reuse=None):
        if threading.current_thread() is threading.main_thread():
            return real(state, reuse)
        time.sleep(delay)  # the training thread has long reached its next optimizer step by now
        out = real(state, reuse)
        ended.append(time.perf_counter())
        return out

    monkeypatch.setattr(ckpt_mixin, "detached_cpu_copy", copy)
    return ended


def test_async_file_holds_the_optimizer_state_at_save_time(tmp_path, monkeypatch):
    _slow_copies_in_the_writer(monkeypatch)
    record = _RecordAtSave()
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    config = quiet_config(tmp_path, n_epochs=1, callbacks=[cb, record], async_checkpointing=True)
    trainer = TwoGroups(config)
    trainer.fit()
    assert sorted(record.at_save) == [1, 2, 3, 4]
    for step, expected in record.at_save.items():
        saved = read_checkpoint(ckpt_dir(tmp_path) / f"epoch=0-step={step}.ckpt")["optimizers"]["optimizer"]
        assert saved["state"].keys() == expected.keys()
        for name, entry in expected.items():
            for key, value in entry.items():
                assert torch.equal(saved["state"][name][key], value), (step, name, key)
        assert [g["params"] for g in saved["param_groups"]] == [["model.0.weight", "model.0.bias"],
                                                                ["model.1.weight", "model.1.bias"]]  # fmt: skip
    assert not trainer.optimizer._optimizer_step_pre_hooks  # the fence is gone after fit


def test_the_step_after_an_async_save_waits_for_the_copy_and_training_is_unchanged(tmp_path, monkeypatch):
    ended = _slow_copies_in_the_writer(monkeypatch)
    stepped: list[float] = []

    class Timed(TwoGroups):
        def configure_optimizers(self) -> None:
            super().configure_optimizers()
            self.optimizer.register_step_post_hook(lambda *a: stepped.append(time.perf_counter()))

    runs = {}
    for mode in (True, False):
        cb = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
        trainer = Timed(quiet_config(tmp_path / str(mode), n_epochs=1, callbacks=[cb], async_checkpointing=mode))
        trainer.fit()
        runs[mode] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        if mode:
            async_steps, copies = list(stepped), list(ended)
        stepped.clear()
    # saves after steps 2 and 4: the writer's copy of step 2's state ended before step 3 did
    assert len(copies) == 2 and copies[0] < async_steps[2]
    for key, value in runs[False].items():
        assert torch.equal(runs[True][key], value), key

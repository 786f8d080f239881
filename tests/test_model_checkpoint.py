"""ModelCheckpoint: Lightning's arguments, seed 002's rotation, last.ckpt, resume and async writes."""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import ckpt_dir

import dream_trainer.callbacks.model_checkpoint as mc_module
import dream_trainer.mixins.checkpoint as ckpt_mixin
from dream_trainer import Callback, CheckpointError, ConfigError, MisconfigurationError, ModelCheckpoint
from dream_trainer.utils.checkpoint_io import read_checkpoint

# --- helpers -----------------------------------------------------------------------------------------------


def files(directory: Path) -> list[str]:
    """Checkpoint files in `directory` (hidden temporaries included, so leftovers show up)."""
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def steps(directory: Path) -> list[int]:
    """The `step=N` of every non-`last` file, sorted."""
    out = []
    for name in files(directory):
        m = re.search(r"step=(\d+)", name)
        if m and name != "last.ckpt":
            out.append(int(m.group(1)))
    return sorted(out)


def saved_step(path: str | Path) -> int:
    return int(read_checkpoint(path)["counters"]["global_step"])


class ScriptedTrainer(TinyTrainer):
    """TinyTrainer whose validation reports `val_script[current_epoch]` as `val_loss`."""

    def __init__(self, config, val_script):
        super().__init__(config)
        self.val_script = list(val_script)

    def validation_step(self, batch, batch_idx):
        return {"val_loss": torch.tensor(float(self.val_script[self.current_epoch]))}


def run(tmp_path, cb, n_epochs=1, cls=TinyTrainer, extra_callbacks=(), ckpt_path=None, **cfg):
    trainer = cls(quiet_config(tmp_path, n_epochs=n_epochs, callbacks=[cb, *extra_callbacks], **cfg))
    trainer.fit(ckpt_path=ckpt_path)
    return trainer


def scripted(tmp_path, cb, script, **cfg):
    trainer = ScriptedTrainer(quiet_config(tmp_path, n_epochs=len(script), callbacks=[cb], **cfg), script)
    trainer.fit()
    return trainer


# --- defaults and cadence ----------------------------------------------------------------------------------


def test_default_saves_every_epoch_and_keeps_only_the_newest(tmp_path):
    cb = ModelCheckpoint()
    run(tmp_path, cb, n_epochs=3)
    assert files(ckpt_dir(tmp_path)) == ["epoch=2-step=12.ckpt"]
    assert Path(cb.best_model_path) == ckpt_dir(tmp_path) / "epoch=2-step=12.ckpt"
    assert saved_step(cb.best_model_path) == 12


def test_every_n_train_steps_with_save_top_k_all(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    run(tmp_path, cb, n_epochs=2)
    assert files(ckpt_dir(tmp_path)) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=1-step=6.ckpt",
        "epoch=1-step=8.ckpt",
    ]
    for name in files(ckpt_dir(tmp_path)):
        assert saved_step(ckpt_dir(tmp_path) / name) == int(re.search(r"step=(\d+)", name).group(1))


def test_never_saves_inside_an_accumulation_window(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    run(tmp_path, cb, n_epochs=2, gradient_accumulation_steps=2)  # 4 batches/epoch -> 2 steps/epoch
    assert steps(ckpt_dir(tmp_path)) == [1, 2, 3, 4]
    for name in files(ckpt_dir(tmp_path)):
        state = read_checkpoint(ckpt_dir(tmp_path) / name)
        assert state["window"] is None, f"{name} was written inside an accumulation window"


def test_filename_template_with_a_metric(tmp_path):
    cb = ModelCheckpoint(filename="{epoch}-{step}-{val_loss:.3f}")
    scripted(tmp_path, cb, [1.234])
    assert files(ckpt_dir(tmp_path)) == ["epoch=0-step=4-val_loss=1.234.ckpt"]


def test_filename_template_with_an_unknown_field_lists_available_metrics(tmp_path):
    cb = ModelCheckpoint(filename="{epoch}-{val_acc:.2f}")
    with pytest.raises(MisconfigurationError) as info:
        run(tmp_path, cb)
    msg = str(info.value)
    assert "val_acc" in msg
    assert "val_loss" in msg and "epoch" in msg and "step" in msg


def test_dirpath_is_respected(tmp_path):
    cb = ModelCheckpoint(dirpath=tmp_path / "elsewhere")
    trainer = run(tmp_path, cb)
    assert files(tmp_path / "elsewhere") == ["epoch=0-step=4.ckpt"]
    assert not ckpt_dir(tmp_path).exists()
    assert trainer.checkpoint_dir == tmp_path / "elsewhere"


# --- monitor / top-k ---------------------------------------------------------------------------------------


def test_monitor_min_keeps_the_two_best(tmp_path):
    cb = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2)
    scripted(tmp_path, cb, [3.0, 1.0, 2.0, 0.5, 4.0])
    assert files(ckpt_dir(tmp_path)) == ["epoch=1-step=8.ckpt", "epoch=3-step=16.ckpt"]
    assert Path(cb.best_model_path) == ckpt_dir(tmp_path) / "epoch=3-step=16.ckpt"
    assert cb.best_model_score == pytest.approx(0.5)


def test_monitor_max_keeps_the_two_best(tmp_path):
    cb = ModelCheckpoint(monitor="val_loss", mode="max", save_top_k=2)
    scripted(tmp_path, cb, [3.0, 1.0, 2.0, 0.5, 4.0])
    assert files(ckpt_dir(tmp_path)) == ["epoch=0-step=4.ckpt", "epoch=4-step=20.ckpt"]
    assert Path(cb.best_model_path) == ckpt_dir(tmp_path) / "epoch=4-step=20.ckpt"
    assert cb.best_model_score == pytest.approx(4.0)


def test_monitor_that_never_exists_raises_naming_available_keys(tmp_path):
    cb = ModelCheckpoint(monitor="val_acc")
    with pytest.raises(MisconfigurationError) as info:
        run(tmp_path, cb)
    msg = str(info.value)
    assert "val_acc" in msg
    assert "val_loss" in msg and "'loss'" in msg


def test_monitor_before_first_validation_warns_instead_of_failing(tmp_path):
    cb = ModelCheckpoint(monitor="val_loss", every_n_train_steps=1, save_top_k=-1)
    with pytest.warns(UserWarning, match="not available yet"):
        run(tmp_path, cb)
    assert steps(ckpt_dir(tmp_path)) == [1, 2, 3, 4]


# --- save_last ---------------------------------------------------------------------------------------------


class _LinkProbe(Callback):
    """After each ModelCheckpoint save, check last.ckpt is a hard link to the newest file. A step's save
    is written at the batch boundary, after on_train_batch_end: the next batch's start, or the end of
    training, is the first moment after it."""

    def __init__(self, mc: ModelCheckpoint):
        self.mc = mc
        self.checked = 0

    def on_train_batch_start(self, trainer, batch, batch_idx):
        if trainer.global_step > 0:
            self._check()

    def on_train_end(self, trainer):
        self._check()

    def _check(self):
        newest = Path(self.mc.last_model_path)
        last = newest.parent / "last.ckpt"
        assert os.path.samefile(last, newest)
        assert last.read_bytes() == newest.read_bytes()
        self.checked += 1


def test_save_last_is_a_hard_link_to_the_newest(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_last=True)
    probe = _LinkProbe(cb)
    run(tmp_path, cb, extra_callbacks=[probe])
    assert probe.checked == 4
    d = ckpt_dir(tmp_path)
    assert files(d) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.path.samefile(d / "last.ckpt", d / "epoch=0-step=4.ckpt")
    assert (d / "last.ckpt").stat().st_nlink == 2


def test_last_survives_rotation_deleting_the_newest(tmp_path):
    # Epoch 1 is worse than epoch 0: its file is rotated away at once, but last.ckpt still holds it.
    cb = ModelCheckpoint(monitor="val_loss", save_top_k=1, save_last=True)
    scripted(tmp_path, cb, [1.0, 2.0])
    d = ckpt_dir(tmp_path)
    assert files(d) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert saved_step(d / "last.ckpt") == 8
    assert saved_step(cb.best_model_path) == 4


def test_save_top_k_zero_with_save_last_writes_only_last(tmp_path):
    cb = ModelCheckpoint(save_top_k=0, save_last=True, every_n_train_steps=1)
    run(tmp_path, cb, n_epochs=2)
    assert files(ckpt_dir(tmp_path)) == ["last.ckpt"]
    assert saved_step(ckpt_dir(tmp_path) / "last.ckpt") == 8


# --- seed 002 rotation -------------------------------------------------------------------------------------


def test_keep_last_n_and_keep_every_n_steps(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=1, keep_last_n=3, keep_every_n_steps=5)
    run(tmp_path, cb, n_epochs=3)  # 12 steps
    assert steps(ckpt_dir(tmp_path)) == [5, 10, 11, 12]
    assert Path(cb.best_model_path).name == "epoch=2-step=12.ckpt"


def test_keep_last_n_alone(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=1, keep_last_n=2)
    run(tmp_path, cb, n_epochs=2)
    assert steps(ckpt_dir(tmp_path)) == [7, 8]


# --- train_time_interval and argument checks ---------------------------------------------------------------


def test_train_time_interval_tiny_saves_every_step(tmp_path):
    cb = ModelCheckpoint(train_time_interval=1e-6, save_top_k=-1)
    run(tmp_path, cb)
    assert steps(ckpt_dir(tmp_path)) == [1, 2, 3, 4]


class _Clock:
    now = 0.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


class _AdvanceClock(Callback):
    """10 fake seconds per training step."""

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        _Clock.now = 10.0 * trainer.global_step


@pytest.mark.parametrize("interval", [25.0, timedelta(seconds=25)])
def test_train_time_interval_with_a_fake_clock(tmp_path, monkeypatch, interval):
    _Clock.now = 0.0
    monkeypatch.setattr(mc_module, "time", _Clock)
    cb = ModelCheckpoint(train_time_interval=interval, save_top_k=-1)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[_AdvanceClock(), cb]))
    trainer.fit()
    # 30 s and 60 s: the first times >= 25 s had passed; and step 8, the final state, when fit ends
    assert steps(ckpt_dir(tmp_path)) == [3, 6, 8]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_n_train_steps": 1, "every_n_epochs": 1},
        {"every_n_train_steps": 1, "train_time_interval": 5.0},
        {"every_n_epochs": 2, "train_time_interval": timedelta(minutes=1)},
    ],
)
def test_two_cadences_raise_config_error(kwargs):
    with pytest.raises(ConfigError, match="only one of"):
        ModelCheckpoint(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "avg"}, "mode"),
        ({"save_top_k": -2}, "save_top_k"),
        ({"save_top_k": 1.5}, "save_top_k"),
        ({"every_n_train_steps": 0}, "every_n_train_steps"),
        ({"keep_last_n": -1}, "keep_last_n"),
        ({"train_time_interval": 0}, "train_time_interval"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ModelCheckpoint(**kwargs)


# --- save_on_exception -------------------------------------------------------------------------------------


class _Exploding(TinyTrainer):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_save_on_exception_writes_an_exception_checkpoint(tmp_path):
    cb = ModelCheckpoint(save_on_exception=True)
    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, cb, cls=_Exploding)
    assert files(ckpt_dir(tmp_path)) == ["epoch=0-step=2-exception.ckpt"]
    assert saved_step(ckpt_dir(tmp_path) / "epoch=0-step=2-exception.ckpt") == 2


def test_no_exception_checkpoint_by_default(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        run(tmp_path, ModelCheckpoint(), cls=_Exploding)
    assert files(ckpt_dir(tmp_path)) == []


# --- resume ------------------------------------------------------------------------------------------------


def test_state_round_trips_and_rotation_continues_after_resume(tmp_path):
    d = ckpt_dir(tmp_path)
    first = ModelCheckpoint(every_n_train_steps=1, save_top_k=2, save_last=True)
    run(tmp_path, first, n_epochs=1)
    assert files(d) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]

    second = ModelCheckpoint(every_n_train_steps=1, save_top_k=2, save_last=True)
    trainer = run(tmp_path, second, n_epochs=2, ckpt_path="last")
    assert trainer.global_step == 8
    assert len(trainer.train_losses) == 4  # only the second epoch ran
    # Files written before the resume (steps 3 and 4) are rotated away like any other.
    assert files(d) == ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert os.path.samefile(d / "last.ckpt", d / "epoch=1-step=8.ckpt")
    assert sorted(r["step"] for r in second.kept) == [7, 8]


def test_state_dict_round_trip(tmp_path):
    cb = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    scripted(tmp_path, cb, [2.0, 1.0, 3.0])
    fresh = ModelCheckpoint(monitor="val_loss", save_top_k=2)
    fresh.load_state_dict(cb.state_dict())
    assert fresh.kept == cb.kept
    assert fresh.best_model_path == cb.best_model_path
    assert fresh.best_model_score == cb.best_model_score
    assert fresh.last_model_path == cb.last_model_path


def test_fit_ckpt_path_last_resumes_from_last_ckpt(tmp_path):
    run(tmp_path, ModelCheckpoint(save_last=True), n_epochs=1)
    trainer = run(tmp_path, ModelCheckpoint(save_last=True), n_epochs=2, ckpt_path="last")
    assert trainer.global_step == 8
    assert len(trainer.train_losses) == 4


def test_fit_ckpt_path_last_in_an_empty_dir_warns_and_starts_from_scratch(tmp_path):
    with pytest.warns(UserWarning, match="starting from scratch"):
        trainer = run(tmp_path, ModelCheckpoint(), n_epochs=1, ckpt_path="last")
    assert trainer.global_step == 4
    assert len(trainer.train_losses) == 4


def test_config_resume_from_last_continues_a_restarted_run(tmp_path):
    def make(n_epochs):
        cfg = quiet_config(tmp_path, n_epochs=n_epochs, resume_from="last", callbacks=[ModelCheckpoint()])
        return TinyTrainer(cfg)

    first = make(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a first start of a resume_from="last" script is expected: no warning
        first.fit()
    assert first.global_step == 4

    second = make(2)
    second.fit()  # no argument: config.resume_from="last"
    assert second.global_step == 8
    assert len(second.train_losses) == 4

    # The resumed run ends where an uninterrupted two-epoch run ends.
    straight = TinyTrainer(quiet_config(tmp_path / "straight", n_epochs=2))
    straight.fit()
    for a, b in zip(second.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)


# --- async checkpointing -----------------------------------------------------------------------------------


def test_async_files_are_complete_after_fit(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = run(tmp_path, cb, n_epochs=2, async_checkpointing=True)
    d = ckpt_dir(tmp_path)
    assert steps(d) == list(range(1, 9))
    assert not [n for n in files(d) if n.startswith(".")], "temporary files left behind"
    for name in files(d):
        state = read_checkpoint(d / name)
        assert state["counters"]["global_step"] == (8 if name == "last.ckpt" else int(name.split("step=")[1][:-5]))
    assert os.path.samefile(d / "last.ckpt", d / "epoch=1-step=8.ckpt")
    final = read_checkpoint(d / "last.ckpt")["models"]["model"]
    assert torch.equal(final["weight"], trainer.model.weight.detach())


class _MutateAfterSave(Callback):
    """Right after the step-2 save (written at the batch boundary: the next batch's start is the first
    moment after it), remember the weights and then change them in place."""

    def __init__(self):
        self.at_save = None

    def on_train_batch_start(self, trainer, batch, batch_idx):
        if trainer.global_step == 2:
            self.at_save = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            with torch.no_grad():
                trainer.model.weight.add_(100.0)
                trainer.model.bias.add_(100.0)


def test_async_file_holds_the_weights_at_save_time(tmp_path, monkeypatch):
    real = ckpt_mixin.atomic_save

    def slow_save(state, path, crc32=True):
        if "step=2" in Path(path).name:
            time.sleep(0.2)  # the trainer has certainly moved on (and mutated the weights) by now
        return real(state, path, crc32)

    monkeypatch.setattr(ckpt_mixin, "atomic_save", slow_save)
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    mutate = _MutateAfterSave()
    run(tmp_path, cb, extra_callbacks=[mutate], async_checkpointing=True)
    saved = read_checkpoint(ckpt_dir(tmp_path) / "epoch=0-step=2.ckpt")["models"]["model"]
    for k, v in mutate.at_save.items():
        assert torch.equal(saved[k], v), k


def _fail_in_worker(fail_if):
    real = ckpt_mixin.atomic_save

    def save(state, path, crc32=True):
        if threading.current_thread() is not threading.main_thread() and fail_if(Path(path)):
            raise OSError(f"disk full while writing {path}")
        return real(state, path, crc32)

    return save


def test_async_write_error_surfaces_at_the_next_save(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_mixin, "atomic_save", _fail_in_worker(lambda p: "step=1" in p.name))
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    trainer = TinyTrainer(quiet_config(tmp_path, callbacks=[cb], async_checkpointing=True))
    with pytest.raises(CheckpointError, match="disk full"):
        trainer.fit()
    assert trainer.global_step < 4  # the run stopped at the next save, not at the end
    assert "epoch=0-step=1.ckpt" not in files(ckpt_dir(tmp_path))


def test_async_write_error_of_the_final_save_fails_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_mixin, "atomic_save", _fail_in_worker(lambda p: True))
    trainer = TinyTrainer(quiet_config(tmp_path, callbacks=[ModelCheckpoint()], async_checkpointing=True))
    with pytest.raises(CheckpointError, match="disk full"):
        trainer.fit()
    assert trainer.global_step == 4


def test_async_write_error_never_deletes_the_previous_good_checkpoint(tmp_path, monkeypatch):
    # save_top_k=1 rotates step 1 away once step 2 is saved. If step 2's background write fails,
    # step 1 must survive: rotation may only delete after the new file is durable.
    monkeypatch.setattr(ckpt_mixin, "atomic_save", _fail_in_worker(lambda p: "step=2" in p.name))
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=1)
    trainer = TinyTrainer(quiet_config(tmp_path, callbacks=[cb], async_checkpointing=True))
    with pytest.raises(CheckpointError, match="disk full"):
        trainer.fit()
    assert "epoch=0-step=1.ckpt" in files(ckpt_dir(tmp_path))
    assert saved_step(ckpt_dir(tmp_path) / "epoch=0-step=1.ckpt") == 1


def test_a_run_ending_between_two_saves_keeps_its_final_weights(tmp_path):
    # every 10 steps, and the run ends at step 12: the final state is saved when fit ends, and
    # save_top_k=1 keeps only it (the step-10 file is rotated away)
    cb = ModelCheckpoint(every_n_train_steps=10, save_top_k=1, save_last=True)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[cb]))
    trainer.fit()
    assert trainer.global_step == 12
    assert sorted(p.name for p in ckpt_dir(tmp_path).iterdir()) == ["epoch=2-step=12.ckpt", "last.ckpt"]
    last = read_checkpoint(ckpt_dir(tmp_path) / "last.ckpt")
    assert last["counters"]["global_step"] == 12
    assert torch.equal(last["models"]["model"]["weight"], trainer.model.weight.detach())
    # a save at the final step already (every 4 steps): nothing is written twice
    cb = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    TinyTrainer(quiet_config(tmp_path / "b", n_epochs=3, callbacks=[cb])).fit()
    assert steps(ckpt_dir(tmp_path / "b")) == [4, 8, 12]

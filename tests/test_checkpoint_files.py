"""Checkpoint files: atomic writes, choosing "last", torn/corrupt/hostile files, origin warnings."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import Hostile, ckpt_dir

from dream_trainer import CheckpointError, ModelCheckpoint
from dream_trainer.utils.checkpoint_io import atomic_save, find_last, read_checkpoint

# --- helpers -----------------------------------------------------------------------------------------------


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def truncate_in_place(path: Path) -> None:
    """Tear `path` the way a crash mid-write would: keep only its first half (same inode)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def replace_with_torn_copy(path: Path) -> None:
    """Replace `path` by a new file (new inode) holding only the first half of its bytes."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2])


def every_step_run(tmp_path: Path, n_epochs: int = 1) -> Path:
    """Train with a checkpoint after every step (all kept) plus last.ckpt; returns the directory."""
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True)
    TinyTrainer(quiet_config(tmp_path, n_epochs=n_epochs, callbacks=[cb])).fit()
    return ckpt_dir(tmp_path)


def warning_texts(record) -> str:
    return "\n".join(str(w.message) for w in record)


# --- atomic_save -------------------------------------------------------------------------------------------


def test_atomic_save_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "sub" / "x.ckpt"
    atomic_save({"a": torch.arange(3)}, path)  # creates the directory
    atomic_save({"a": torch.arange(4)}, path)  # replaces
    assert listing(tmp_path / "sub") == ["x.ckpt"]
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(4))


def test_atomic_save_failing_inside_torch_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "x.ckpt"
    atomic_save({"a": torch.arange(3)}, path)
    before = path.read_bytes()
    unpicklable = {"a": torch.arange(5), "fn": lambda: 0}  # torch.save writes a header, then fails
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises for a lambda
        atomic_save(unpicklable, path)
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["x.ckpt"]


# --- find_last ---------------------------------------------------------------------------------------------


def test_find_last_prefers_last_ckpt(tmp_path):
    d = every_step_run(tmp_path)
    path, state = find_last(d)
    assert path == d / "last.ckpt"
    assert state["counters"]["global_step"] == 4


def test_find_last_skips_a_torn_last_ckpt_with_a_warning(tmp_path):
    d = every_step_run(tmp_path)
    replace_with_torn_copy(d / "last.ckpt")
    with pytest.warns(UserWarning) as record:
        path, state = find_last(d)
    assert path == d / "epoch=0-step=4.ckpt"
    assert state["counters"]["global_step"] == 4
    assert "last.ckpt" in warning_texts(record)


def test_find_last_torn_hard_link_falls_back_to_the_previous_step(tmp_path):
    # last.ckpt and the step-4 file share an inode: tearing one tears both.
    d = every_step_run(tmp_path)
    truncate_in_place(d / "last.ckpt")
    with pytest.warns(UserWarning) as record:
        path, state = find_last(d)
    assert path == d / "epoch=0-step=3.ckpt"
    assert state["counters"]["global_step"] == 3
    text = warning_texts(record)
    assert "last.ckpt" in text and "epoch=0-step=4.ckpt" in text
    # One short warning for the one torn file (last.ckpt is a hard link to it), without torch's paragraph.
    assert len(record) == 1 and "\n" not in text and "PytorchStreamReader" not in text, text


def test_find_last_skips_a_truncated_newest_epoch_file(tmp_path):
    cb = ModelCheckpoint(save_top_k=-1)
    TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[cb])).fit()
    d = ckpt_dir(tmp_path)
    assert listing(d) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    truncate_in_place(d / "epoch=2-step=12.ckpt")
    with pytest.warns(UserWarning, match=r"epoch=2-step=12\.ckpt"):
        path, state = find_last(d)
    assert path == d / "epoch=1-step=8.ckpt"
    assert state["counters"]["global_step"] == 8


def test_find_last_orders_by_step_not_by_name(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[cb])).fit()  # steps 1..12: "step=9" > "step=12"
    path, state = find_last(ckpt_dir(tmp_path))
    assert path.name == "epoch=2-step=12.ckpt"
    assert state["counters"]["global_step"] == 12


def test_find_last_empty_or_missing_directory_is_none(tmp_path):
    (tmp_path / "empty").mkdir()
    assert find_last(tmp_path / "empty") is None
    assert find_last(tmp_path / "missing") is None


def test_find_last_ignores_hidden_temporaries(tmp_path):
    d = every_step_run(tmp_path)
    (d / ".epoch=0-step=99.ckpt.tmp-1-2").write_bytes(b"partial")
    (d / "last.ckpt").unlink()
    path, _ = find_last(d)
    assert path.name == "epoch=0-step=4.ckpt"


def test_fit_ckpt_path_last_follows_the_same_rule(tmp_path):
    d = every_step_run(tmp_path)
    truncate_in_place(d / "epoch=0-step=4.ckpt")  # also tears last.ckpt (same inode)
    resumed = TinyTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[ModelCheckpoint(save_last=True)]))
    with pytest.warns(UserWarning) as record:
        resumed.fit(ckpt_path="last")
    text = warning_texts(record)
    assert "last.ckpt" in text and "epoch=0-step=4.ckpt" in text
    assert resumed.global_step == 4
    assert len(resumed.train_losses) == 1  # resumed after step 3: only the 4th batch ran

    straight = TinyTrainer(quiet_config(tmp_path / "straight", n_epochs=1))
    straight.fit()
    for a, b in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fit_ckpt_path_last_with_only_corrupt_files_starts_from_scratch(tmp_path):
    d = tmp_path / "checkpoints"  # the layout of earlier versions, which "last" still reads
    d.mkdir()
    (d / "last.ckpt").write_bytes(b"garbage")
    (d / "epoch=0-step=4.ckpt").write_bytes(b"")
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    with pytest.warns(UserWarning) as record:
        trainer.fit(ckpt_path="last")
    text = warning_texts(record)
    assert "starting from scratch" in text
    assert "last.ckpt" in text and "epoch=0-step=4.ckpt" in text
    assert trainer.global_step == 4
    assert len(trainer.train_losses) == 4


# --- corrupt files loaded directly -------------------------------------------------------------------------


def test_load_checkpoint_of_a_torn_file_raises_naming_it(tmp_path):
    d = every_step_run(tmp_path)
    path = d / "epoch=0-step=2.ckpt"
    truncate_in_place(path)
    with pytest.raises(CheckpointError) as info:
        TinyTrainer(quiet_config(tmp_path)).load_checkpoint(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "truncated" in msg or "not a checkpoint" in msg


def test_load_checkpoint_of_an_empty_file_raises(tmp_path):
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.ckpt"):
        TinyTrainer(quiet_config(tmp_path)).load_checkpoint(path)


# --- origin checks -----------------------------------------------------------------------------------------


class OtherTrainer(TinyTrainer):
    pass


def _saved(tmp_path: Path, **cfg) -> Path:
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, **cfg))
    trainer.fit()
    return trainer.save_checkpoint(tmp_path / "origin.ckpt")


def test_checkpoint_from_another_trainer_class_warns_naming_both(tmp_path):
    path = _saved(tmp_path)
    with pytest.warns(UserWarning) as record:
        OtherTrainer(quiet_config(tmp_path)).load_checkpoint(path)
    text = warning_texts(record)
    assert "TinyTrainer" in text and "OtherTrainer" in text


@pytest.mark.parametrize(
    ("field", "saved_value", "new_value"),
    [("gradient_clip_val", None, 1.0), ("gradient_accumulation_steps", 1, 2), ("seed", 42, 7)],
)
def test_checkpoint_with_another_config_warns_naming_field_and_values(tmp_path, field, saved_value, new_value):
    path = _saved(tmp_path, **{field: saved_value})
    with pytest.warns(UserWarning) as record:
        TinyTrainer(quiet_config(tmp_path, **{field: new_value})).load_checkpoint(path)
    text = warning_texts(record)
    assert field in text
    assert repr(saved_value) in text and repr(new_value) in text


def test_mixed_precision_change_warns(tmp_path):
    path = _saved(tmp_path)
    with pytest.warns(UserWarning, match="mixed_precision") as record:
        TinyTrainer(quiet_config(tmp_path, mixed_precision="bf16")).load_checkpoint(path)
    assert "'bf16'" in warning_texts(record)


def test_resumable_changes_do_not_warn(tmp_path):
    path = _saved(tmp_path)
    cfg = quiet_config(tmp_path, n_epochs=5, max_steps=100, log_every_n_steps=7, callbacks=[ModelCheckpoint()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TinyTrainer(cfg).load_checkpoint(path)


# --- hostile pickles ---------------------------------------------------------------------------------------


def _hostile_state(tmp_path: Path, marker: Path) -> dict:
    trainer = TinyTrainer(quiet_config(tmp_path / "src", n_epochs=1))
    trainer.fit()
    state = trainer.state_dict()
    state["callbacks"]["Evil"] = {"payload": Hostile(marker)}
    return state


def test_hostile_last_ckpt_is_refused_by_find_last(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "checkpoints"  # the layout of earlier versions, which "last" still reads
    d.mkdir()
    torch.save(_hostile_state(tmp_path, marker), d / "last.ckpt")
    assert not marker.exists()
    with pytest.warns(UserWarning, match=r"last\.ckpt") as record:
        assert find_last(d) is None
    assert "refused" in warning_texts(record)
    assert not marker.exists()


def test_hostile_last_ckpt_falls_back_to_a_valid_file(tmp_path):
    marker = tmp_path / "pwned"
    d = every_step_run(tmp_path)
    (d / "last.ckpt").unlink()
    torch.save(_hostile_state(tmp_path, marker), d / "last.ckpt")
    with pytest.warns(UserWarning, match=r"last\.ckpt"):
        path, _ = find_last(d)
    assert path.name == "epoch=0-step=4.ckpt"
    assert not marker.exists()


def test_hostile_last_ckpt_is_refused_by_fit(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "checkpoints"  # the layout of earlier versions, which "last" still reads
    d.mkdir()
    torch.save(_hostile_state(tmp_path, marker), d / "last.ckpt")
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1))
    with pytest.warns(UserWarning) as record:
        trainer.fit(ckpt_path="last")
    text = warning_texts(record)
    assert "last.ckpt" in text and "starting from scratch" in text
    assert trainer.global_step == 4
    assert not marker.exists()


def test_read_checkpoint_refuses_a_hostile_file_by_path(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "hostile.ckpt"
    torch.save(_hostile_state(tmp_path, marker), path)
    # Control: an unsafe load really runs the payload, so "no marker" below means something.
    control = tmp_path / "control"
    torch.save({"x": Hostile(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()
    with pytest.raises(CheckpointError, match=r"hostile\.ckpt"):
        read_checkpoint(path)
    assert not marker.exists()

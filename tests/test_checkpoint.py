"""Checkpoints on one process: what a round trip restores, resuming, atomic writes, and refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import Hostile
from torch import nn
from torch.utils.data import DataLoader

from dream_trainer import Callback, CheckpointError


class MomentumTrainer(TinyTrainer):
    """TinyTrainer with optimizer state (momentum) and an LR scheduler, so both have something to restore."""

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)


def _assert_nested_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_nested_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_nested_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _trained(tmp_path, n_epochs=2, cls=MomentumTrainer, **cfg):
    trainer = cls(quiet_config(tmp_path, n_epochs=n_epochs, **cfg))
    trainer.fit()
    return trainer


# --- round trip -----------------------------------------------------------------------------------------
def test_round_trip_restores_everything(tmp_path):
    trainer = _trained(tmp_path)
    assert trainer.global_step == 8 and trainer.current_epoch == 2
    path = tmp_path / "ckpt.pt"
    returned = trainer.save_checkpoint(path)
    assert Path(returned) == path and path.is_file()

    fresh = MomentumTrainer(quiet_config(tmp_path, n_epochs=2))
    # A fresh trainer's weights differ from the trained ones (otherwise the test proves nothing).
    assert not torch.equal(fresh.model.weight, trainer.model.weight)
    fresh.load_checkpoint(path)  # sets the trainer up by itself

    for (name, p), (_, q) in zip(trainer.model.state_dict().items(), fresh.model.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    opt_state = trainer.optimizer.state_dict()
    assert opt_state["state"], "momentum buffers expected"
    _assert_nested_equal(opt_state, fresh.optimizer.state_dict(), "optimizer")
    assert fresh.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"] == 0.05 * 0.5**2
    _assert_nested_equal(trainer.scheduler.state_dict(), fresh.scheduler.state_dict(), "scheduler")
    assert fresh.scheduler.last_epoch == 2
    assert fresh.global_step == 8
    # Written after the final epoch: resumes at the next epoch index.
    assert fresh.current_epoch == 2


def test_optimizer_in_loaded_trainer_drives_the_loaded_model(tmp_path):
    trainer = _trained(tmp_path)
    path = trainer.save_checkpoint(tmp_path / "ckpt.pt")
    fresh = MomentumTrainer(quiet_config(tmp_path))
    fresh.load_checkpoint(path)
    model_params = {id(p) for p in fresh.model.parameters()}
    opt_params = {id(p) for g in fresh.optimizer.param_groups for p in g["params"]}
    assert model_params == opt_params
    assert fresh.scheduler.optimizer is fresh.optimizer


def test_checkpoint_written_in_on_train_epoch_end_resumes_at_next_epoch(tmp_path):
    class SaveAtEpochEnd(Callback):
        def on_train_epoch_end(self, trainer):
            if trainer.current_epoch == 0:
                trainer.save_checkpoint(tmp_path / "epoch0.pt")

    trainer = MomentumTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[SaveAtEpochEnd()]))
    trainer.fit()
    fresh = MomentumTrainer(quiet_config(tmp_path, n_epochs=2))
    fresh.load_checkpoint(tmp_path / "epoch0.pt")
    assert fresh.global_step == 4
    assert fresh.current_epoch == 1


def test_fp16_grad_scaler_state_round_trips(tmp_path):
    trainer = _trained(tmp_path, cls=TinyTrainer, mixed_precision="fp16")
    saved = trainer.grad_scaler.state_dict()
    path = trainer.save_checkpoint(tmp_path / "amp.pt")

    fresh = TinyTrainer(quiet_config(tmp_path, mixed_precision="fp16"))
    default = fresh.grad_scaler.state_dict()
    assert saved != default  # the run moved the scaler away from its initial state
    fresh.load_checkpoint(path)
    assert fresh.grad_scaler.state_dict() == saved
    assert fresh.grad_scaler.get_scale() == trainer.grad_scaler.get_scale()


def test_continue_fit_after_load_checkpoint_matches_uninterrupted_run(tmp_path):
    straight = _trained(tmp_path / "a", n_epochs=4)

    first = _trained(tmp_path / "b", n_epochs=2)
    path = first.save_checkpoint(tmp_path / "b" / "half.pt")
    resumed = MomentumTrainer(quiet_config(tmp_path / "b", n_epochs=4))
    resumed.load_checkpoint(path)
    resumed.fit()

    assert resumed.global_step == 16
    assert resumed.current_epoch == 4
    assert len(resumed.train_losses) == 8  # only epochs 3 and 4 ran
    assert torch.equal(resumed.model.weight, straight.model.weight)
    assert torch.equal(resumed.model.bias, straight.model.bias)
    assert resumed.scheduler.last_epoch == straight.scheduler.last_epoch == 4


class ShuffledTrainer(MomentumTrainer):
    """Shuffled training data: resuming bit-exactly needs the RNG state from the checkpoint."""

    def configure_dataloaders(self):
        train, val = super().configure_dataloaders()
        return DataLoader(train.dataset, batch_size=self.batch_size, shuffle=True), val


def test_resume_restores_rng_so_shuffled_epochs_match(tmp_path):
    straight = _trained(tmp_path / "a", n_epochs=3, cls=ShuffledTrainer)

    first = _trained(tmp_path / "b", n_epochs=1, cls=ShuffledTrainer)
    path = first.save_checkpoint(tmp_path / "b" / "one.pt")
    torch.manual_seed(1234)  # whatever the process did in between must not matter
    resumed = ShuffledTrainer(quiet_config(tmp_path / "b", n_epochs=3))
    resumed.fit(ckpt_path=path)

    assert resumed.global_step == straight.global_step == 12
    for got, want in zip(resumed.train_losses, straight.train_losses[4:], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(resumed.model.weight, straight.model.weight)


def test_mid_epoch_checkpoint_resumes_at_the_saved_batch(tmp_path):
    # DESIGN.md: the state holds the data position (mid-epoch), so a resumed run continues bit-exactly.
    class SaveAtStep(Callback):
        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                trainer.save_checkpoint(tmp_path / "mid.pt")

    straight = _trained(tmp_path / "a", n_epochs=2)
    interrupted = MomentumTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[SaveAtStep()]))
    interrupted.fit()

    resumed = MomentumTrainer(quiet_config(tmp_path, n_epochs=2))
    resumed.fit(ckpt_path=tmp_path / "mid.pt")
    assert len(resumed.train_losses) == 6  # batches 2, 3 of epoch 1, then epoch 2
    assert resumed.global_step == 8
    assert resumed.current_epoch == 2
    assert torch.equal(resumed.model.weight, straight.model.weight)


def test_fit_with_ckpt_path_resumes(tmp_path):
    first = _trained(tmp_path, n_epochs=1)
    path = first.save_checkpoint(tmp_path / "one.pt")
    resumed = MomentumTrainer(quiet_config(tmp_path, n_epochs=3))
    resumed.fit(ckpt_path=path)
    assert resumed.global_step == 12
    assert resumed.current_epoch == 3
    assert len(resumed.train_losses) == 8


# --- files -------------------------------------------------------------------------------------------------
def test_save_is_atomic_and_leaves_no_temp_file(tmp_path):
    trainer = _trained(tmp_path)
    out = tmp_path / "ckpts"
    trainer.save_checkpoint(out / "last.pt")  # creates the directory
    trainer.save_checkpoint(out / "last.pt")  # overwrites
    assert sorted(os.listdir(out)) == ["last.pt"]


def test_failed_save_keeps_the_previous_file_and_no_temp(tmp_path, monkeypatch):
    trainer = _trained(tmp_path)
    path = tmp_path / "last.pt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()

    real_save = torch.save

    def broken_save(obj, f, *args, **kwargs):
        real_save({"partial": torch.zeros(3)}, f)  # some bytes hit the file first
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "version_0"]  # version_0: the run's own directory


def test_missing_path_raises_checkpoint_error_naming_it(tmp_path):
    missing = tmp_path / "nope" / "missing.pt"
    trainer = MomentumTrainer(quiet_config(tmp_path))
    with pytest.raises(CheckpointError) as info:
        trainer.load_checkpoint(missing)
    assert str(missing) in str(info.value)


def test_missing_model_key_raises_and_suggests_strict_false(tmp_path):
    trainer = _trained(tmp_path)
    state = trainer.state_dict()
    del state["models"]["model"]
    path = tmp_path / "no_model.pt"
    torch.save(state, path)

    fresh = MomentumTrainer(quiet_config(tmp_path))
    with pytest.raises(CheckpointError) as info:
        fresh.load_checkpoint(path)
    assert "'model'" in str(info.value)
    assert "strict=False" in str(info.value)

    # strict=False loads the rest (the optimizer state) and leaves the model alone.
    fresh2 = MomentumTrainer(quiet_config(tmp_path))
    initial = fresh2.model.weight.detach().clone()
    fresh2.load_checkpoint(path, strict=False)
    assert torch.equal(fresh2.model.weight, initial)
    assert fresh2.global_step == 8


def test_shape_mismatch_raises_checkpoint_error(tmp_path):
    class Wider(MomentumTrainer):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return {"loss": ((self.model(x) - y) ** 2).mean()}

    trainer = _trained(tmp_path)
    path = trainer.save_checkpoint(tmp_path / "narrow.pt")
    with pytest.raises(CheckpointError) as info:
        Wider(quiet_config(tmp_path)).load_checkpoint(path)
    first, *details = str(info.value).splitlines()
    assert "'model'" in first and "another shape" in first and len(first) < 300
    assert "  another shape: weight: [1, 4] in the checkpoint, [2, 4] here" in details


def test_not_a_checkpoint_raises(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(1, 4)}, path)
    with pytest.raises(CheckpointError, match="not a dream_trainer checkpoint"):
        MomentumTrainer(quiet_config(tmp_path)).load_checkpoint(path)


def test_corrupt_file_raises_checkpoint_error(tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError) as info:
        MomentumTrainer(quiet_config(tmp_path)).load_checkpoint(path)
    assert str(path) in str(info.value)
    # Said plainly: torch alone would call it a "weights only" refusal, pages long.
    assert "is not a checkpoint" in str(info.value) and "Weights only" not in str(info.value)


def test_hostile_pickle_is_refused_and_never_runs(tmp_path):
    # Control: the payload really does run under an unsafe load, so the check below means something.
    control = tmp_path / "control"
    torch.save({"x": Hostile(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()

    trainer = _trained(tmp_path)
    state = trainer.state_dict()
    marker = tmp_path / "pwned"
    state["callbacks"]["Evil"] = {"payload": Hostile(marker)}
    path = tmp_path / "hostile.pt"
    torch.save(state, path)
    assert not marker.exists()

    with pytest.raises(CheckpointError) as info:
        MomentumTrainer(quiet_config(tmp_path)).load_checkpoint(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


# --- hooks -----------------------------------------------------------------------------------------------
def test_on_save_and_on_load_checkpoint_hooks_get_the_dict(tmp_path):
    events: list[tuple[str, dict]] = []

    class Extra(Callback):
        def on_save_checkpoint(self, trainer, checkpoint):
            assert "models" in checkpoint and "optimizers" in checkpoint
            checkpoint["extra"] = {"note": "hello", "value": torch.tensor([1.0, 2.0])}
            events.append(("save", checkpoint))

        def on_load_checkpoint(self, trainer, checkpoint):
            events.append(("load", checkpoint))

    class HookedTrainer(MomentumTrainer):
        def on_save_checkpoint(self, checkpoint):
            events.append(("trainer_save", checkpoint))

        def on_load_checkpoint(self, checkpoint):
            events.append(("trainer_load", checkpoint))

    trainer = HookedTrainer(quiet_config(tmp_path, callbacks=[Extra()]))
    trainer.fit()
    path = trainer.save_checkpoint(tmp_path / "hooks.pt")
    assert [e for e, _ in events] == ["save", "trainer_save"]
    assert events[0][1] is events[1][1]

    on_disk = torch.load(path)
    assert on_disk["extra"]["note"] == "hello"
    assert torch.equal(on_disk["extra"]["value"], torch.tensor([1.0, 2.0]))

    events.clear()
    HookedTrainer(quiet_config(tmp_path, callbacks=[Extra()])).load_checkpoint(path)
    assert [e for e, _ in events] == ["load", "trainer_load"]
    loaded = events[0][1]
    assert loaded["extra"]["note"] == "hello"
    assert "models" in loaded

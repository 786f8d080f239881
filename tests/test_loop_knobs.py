"""Lightning's debugging and loop knobs: fast_dev_run, overfit_batches, limit_test/predict_batches,
reload_dataloaders_every_n_epochs, deterministic, detect_anomaly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingCallback, TinyTrainer, quiet_config
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainerConfig


class Counting(TinyTrainer):
    """TinyTrainer (16 train / 8 val samples, batches of 4) with test/predict steps, counting batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "test": [], "predict": []}
        self.loads = 0

    def configure_dataloaders(self):
        self.loads += 1
        return super().configure_dataloaders()

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(batch[0])
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(batch[0])
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.seen["test"].append(batch[0])
        return {"test_loss": F.mse_loss(self.model(batch[0]), batch[1])}

    def predict_step(self, batch, batch_idx):
        self.seen["predict"].append(batch[0])
        return self.model(batch[0])


def _loader(n: int = 16) -> DataLoader:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def test_fast_dev_run_runs_n_batches_of_every_loop_and_keeps_nothing(tmp_path, capsys):
    rec = RecordingCallback()
    config = DreamTrainerConfig(
        root_dir=str(tmp_path), fast_dev_run=2, n_epochs=5, callbacks=[rec], enable_progress_bar=False
    )
    trainer = Counting(config)
    trainer.fit()
    trainer.test(_loader())
    trainer.predict(_loader())
    assert {k: len(v) for k, v in trainer.seen.items()} == {"train": 2, "val": 2, "test": 2, "predict": 2}
    assert trainer.global_step == 2 and trainer.current_epoch == 1  # one epoch, whatever n_epochs said
    assert "fast_dev_run" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run directory, logs or checkpoints under root_dir
    scratch = trainer.run_dir
    del trainer
    import gc

    gc.collect()
    assert not scratch.exists()  # the temporary run directory is gone with the trainer


def test_overfit_batches_trains_and_validates_on_the_same_first_batches(tmp_path):
    class Shuffled(Counting):
        def configure_dataloaders(self):
            x = torch.arange(64.0).reshape(16, 4)
            data = TensorDataset(x, x.sum(1, keepdim=True))
            return DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=4)

    trainer = Shuffled(quiet_config(tmp_path, n_epochs=3, overfit_batches=2, num_sanity_val_steps=0))
    trainer.fit()
    first_two = torch.arange(32.0).reshape(8, 4)
    train = trainer.seen["train"]
    assert len(train) == 6  # 2 batches x 3 epochs
    for epoch in range(3):  # in order, the same ones, although the loader shuffles
        assert torch.equal(torch.cat(train[2 * epoch : 2 * epoch + 2]), first_two)
    assert torch.equal(torch.cat(trainer.seen["val"][:2]), first_two)


@pytest.mark.parametrize(("limit", "batches"), [(1, 1), (0.5, 2), (None, 4)])
def test_limit_test_and_predict_batches(tmp_path, limit, batches):
    trainer = Counting(quiet_config(tmp_path, limit_test_batches=limit, limit_predict_batches=limit))
    trainer.test(_loader())
    assert len(trainer.predict(_loader())) == batches
    assert len(trainer.seen["test"]) == batches


def test_reload_dataloaders_every_n_epochs(tmp_path):
    trainer = Counting(quiet_config(tmp_path, n_epochs=5, reload_dataloaders_every_n_epochs=2))
    trainer.fit()
    assert trainer.loads == 3  # setup, then before epochs 2 and 4 (0-based)
    once = Counting(quiet_config(tmp_path, n_epochs=5))
    once.fit()
    assert once.loads == 1


def test_deterministic_turns_on_torchs_switch(tmp_path):
    before = torch.are_deterministic_algorithms_enabled()
    try:
        Counting(quiet_config(tmp_path, deterministic="warn")).fit()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_detect_anomaly_names_the_forward_op_of_a_nan_backward(tmp_path):
    class NaNGrad(Counting):
        def training_step(self, batch, batch_idx):
            out = self.model(batch[0])
            return torch.sqrt(out - out.detach() - 1.0).sum()  # sqrt(-1): NaN, and a NaN gradient

    with pytest.raises(RuntimeError, match="SqrtBackward0"):
        NaNGrad(quiet_config(tmp_path, detect_anomaly=True)).fit()
    NaNGrad(quiet_config(tmp_path, non_finite_loss="ignore")).fit()  # without it nothing raises


@pytest.mark.parametrize(
    ("sanity", "limit_val", "batches"),
    [(-1, None, 3), (-1, 2, 2), (2, None, 2), (5, 1, 1)],  # -1: all; never more than limit_val_batches
)
def test_num_sanity_val_steps_counts_as_lightning(tmp_path, sanity, limit_val, batches):
    seen_in_sanity: list[int] = []

    class Sanity(Counting):
        def on_sanity_check_end(self):
            seen_in_sanity.append(len(self.seen["val"]))

    config = quiet_config(tmp_path, num_sanity_val_steps=sanity, limit_val_batches=limit_val)
    Sanity(config, n_val=12).fit()  # 12 validation samples: 3 batches of 4
    assert seen_in_sanity == [batches]


def test_lightning_1x_trainer_arguments_are_named_too():
    from dataclasses import fields

    from dream_trainer import ConfigError
    from dream_trainer.lightning.trainer_args import OLDER_TRAINER_ARGUMENTS, TRAINER_ARGUMENTS

    with pytest.raises(ConfigError, match=r"'resume_from_checkpoint' is Lightning's .*write resume_from="):
        DreamTrainerConfig(resume_from_checkpoint="last.ckpt")
    with pytest.raises(ConfigError, match=r"'n_epoch': did you mean 'n_epochs'"):
        DreamTrainerConfig(n_epoch=2)
    ours = {f.name for f in fields(DreamTrainerConfig)}
    assert not set(OLDER_TRAINER_ARGUMENTS) & set(TRAINER_ARGUMENTS)  # each name in one table
    assert {m.field for m in OLDER_TRAINER_ARGUMENTS.values() if m.field} <= ours


# --- how long: n_epochs and max_steps ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("limits", "steps", "epochs", "end_line"),
    [
        # max_steps inside epoch 2 (0-based; the end line counts from 1) is no epoch end: epoch 2 is not counted
        ({"max_steps": 10}, 10, 2, "training ended: stopped at max_steps=10 (step 10, epoch 3)"),
        ({}, 4, 1, None),  # neither: one epoch, as before
        ({"n_epochs": 2}, 8, 2, None),
        ({"n_epochs": 2, "max_steps": 5}, 5, 1, "training ended: stopped at max_steps=5 (step 5, epoch 2)"),
        (
            {"n_epochs": 2, "max_steps": 100},
            8,
            2,
            "training ended: n_epochs=2 reached before max_steps=100 (step 8, epoch 2)",
        ),
    ],
)
def test_max_steps_alone_trains_that_many_steps_and_the_end_says_which_limit(
    tmp_path, capsys, limits, steps, epochs, end_line
):
    trainer = Counting(quiet_config(tmp_path, print_epoch_summary=True, **limits))  # 4 batches per epoch
    trainer.fit()
    assert (trainer.global_step, trainer.current_epoch, len(trainer.seen["train"])) == (steps, epochs, steps)
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("training ended")] == ([end_line] if end_line else [])
    if end_line:
        assert out[-1] == end_line  # after the last epoch's summary


def test_max_steps_alone_with_an_epoch_that_runs_no_step_ends_with_a_warning(tmp_path):
    class SkipsEverything(Callback):
        def on_train_batch_start(self, trainer, batch, batch_idx):
            return -1  # Lightning's "skip the rest of the epoch"

    trainer = Counting(quiet_config(tmp_path, max_steps=10, callbacks=[SkipsEverything()]))
    with pytest.warns(UserWarning, match=r"max_steps=10 cannot be reached: epoch 1 ran no training step") as rec:
        trainer.fit()
    assert trainer.global_step == 0 and trainer.current_epoch == 1  # ended, not looping for ever
    assert rec[0].filename == __file__  # the warning points at the user's fit() call

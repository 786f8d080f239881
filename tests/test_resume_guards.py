"""What a resume restores that no other test pins down: Python's and NumPy's global RNGs, which checkpoint
`fit(ckpt_path="last")` picks when the run failed, and where a plain iterable loader continues mid-epoch.

Each test is a user's view of one piece of code, which breaking would otherwise go unnoticed:

- `random.setstate` and `np.random.set_state` in `dream_trainer/utils/seed.py::set_rng_state` (called on
  load by `StateDictMixin._load_rng`, the only call for a checkpoint written at an epoch's end, and again
  mid-epoch by `DreamTrainer._iter_train_batches`): an augmentation drawing from `random` or
  `numpy.random` continues, after a resume, with the draws the uninterrupted run made;
- the `EXCEPTION_TAG` terms of `dream_trainer/utils/checkpoint_io.py`: `_newest_first`'s sort key, and
  where `_candidates` places a `last.ckpt` that is no link to a file: a `-exception` checkpoint
  (`ModelCheckpoint(save_on_exception=True)`) is tried only after every other one, however new it is;
- the skip loop of `dream_trainer/utils/data_resume.py::resumed_iterator` for loaders that are neither a
  `DataLoader` nor have a `state_dict()`: the same RNG replays the epoch's order and the batches done
  before the checkpoint are stepped over, so the resumed run trains exactly the batches not yet trained.

The runs are A (uninterrupted), B (writes a checkpoint, then "crashes") and C (a new trainer resuming
from B's checkpoint), as in test_data_resume.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from helpers import ckpt_dir

from dream_trainer import Callback, ModelCheckpoint


class Crash(Exception):
    """Stands for the process dying right after a checkpoint was written."""


class SaveThenCrash(Callback):
    """Writes `path` after batch `batch_idx` of epoch `epoch` (None: at the end of epoch `epoch`), then crashes."""

    def __init__(self, path: Path, epoch: int, batch_idx: int | None) -> None:
        self.path, self.epoch, self.batch_idx = path, epoch, batch_idx

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.batch_idx is not None and trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)
            raise Crash

    def on_train_epoch_end(self, trainer: Any) -> None:
        if self.batch_idx is None and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            raise Crash


def _assert_same_weights(got: TinyTrainer, want: TinyTrainer) -> None:
    for (name, a), b in zip(got.model.state_dict().items(), want.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs from the uninterrupted run"


# --- (a), (b): Python's and NumPy's global RNGs -------------------------------------------------------------
def _python_draw() -> float:
    return random.random()


def _numpy_draw() -> float:
    return float(np.random.rand())


class AugmentingTrainer(TinyTrainer):
    """TinyTrainer (4 batches an epoch, no validation) whose augmentation scales each batch by a random
    draw: `draws` records them, and the weights depend on every one."""

    def __init__(self, config: Any, draw: Callable[[], float]) -> None:
        super().__init__(config, n_val=0)
        self.draw = draw
        self.draws: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        scale = 1.0 + self.draw()
        self.draws.append(scale)
        return {"loss": F.mse_loss(self.model(x * scale), y)}


@pytest.mark.parametrize("draw", [_python_draw, _numpy_draw], ids=["random", "numpy"])
@pytest.mark.parametrize(("epoch", "batch_idx", "done"), [(1, 1, 6), (0, None, 4)], ids=["mid-epoch", "epoch-end"])
def test_augmentation_random_draws_continue_after_resume(tmp_path, draw, epoch, batch_idx, done):
    """A resumed run draws what the uninterrupted run drew from `random` / `numpy.random`, so its weights
    are the same. (Every run has the same `config.seed`: a trainer that only re-seeded at setup would draw
    the run's first numbers again.)"""
    ckpt = tmp_path / "resume.ckpt"
    a = AugmentingTrainer(quiet_config(tmp_path / "a", n_epochs=3), draw)
    a.fit()
    b = AugmentingTrainer(
        quiet_config(tmp_path / "b", n_epochs=3, callbacks=[SaveThenCrash(ckpt, epoch, batch_idx)]), draw
    )
    with pytest.raises(Crash):
        b.fit()
    assert len(b.draws) == done
    c = AugmentingTrainer(quiet_config(tmp_path / "b", n_epochs=3), draw)
    c.fit(ckpt_path=ckpt)

    assert len(a.draws) == 12
    assert b.draws + c.draws == a.draws
    _assert_same_weights(c, a)


# --- (c): "last" never prefers a checkpoint written when the run failed -------------------------------------
class FailingTrainer(TinyTrainer):
    """TinyTrainer (no validation) whose `training_step` raises at global step `fail_at` (None: never)."""

    def __init__(self, config: Any, fail_at: int | None) -> None:
        super().__init__(config, n_val=0)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        if self.global_step == self.fail_at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


class StartStep(Callback):
    """The global step training (re)starts from."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: Any) -> None:
        self.step = trainer.global_step


# How the normal checkpoint is kept: a file plus last.ckpt (a hard link to it), the file alone, or only
# last.ckpt written directly (save_top_k=0), which "last" places among the files by its time.
KEEP = {
    "file+last.ckpt": ({"save_last": True}, ["epoch=0-step=2.ckpt", "last.ckpt"]),
    "file": ({"save_last": False}, ["epoch=0-step=2.ckpt"]),
    "last.ckpt-only": ({"save_top_k": 0}, ["last.ckpt"]),
}


@pytest.mark.parametrize("keep", list(KEEP))
def test_last_resumes_from_the_newest_normal_checkpoint_not_a_newer_exception_one(tmp_path, keep):
    """docs/checkpointing.md: "last" continues from the newest valid checkpoint; a `-exception` file (the
    state when `fit()` failed, maybe half-way through a step) is tried only after every other one, even
    when it is newer by step and by time."""
    kwargs, normal = KEEP[keep]

    def checkpoint() -> ModelCheckpoint:
        return ModelCheckpoint(every_n_train_steps=2, save_on_exception=True, **kwargs)

    failing = FailingTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[checkpoint()]), fail_at=3)
    with pytest.raises(RuntimeError, match="boom"):
        failing.fit()
    names = sorted(p.name for p in ckpt_dir(tmp_path).iterdir())
    assert names == sorted([*normal, "epoch=0-step=3-exception.ckpt"])

    start = StartStep()
    resumed = FailingTrainer(quiet_config(tmp_path, n_epochs=1, callbacks=[checkpoint(), start]), fail_at=None)
    resumed.fit(ckpt_path="last")
    assert resumed.run_dir == failing.run_dir  # the failed run continues
    assert start.step == 2, f"resumed from the step-{start.step} checkpoint, not the step-2 one"
    assert len(resumed.train_losses) == 2  # batches 2 and 3 of the epoch
    assert resumed.global_step == 4


# --- (d): a plain iterable loader resumed mid-epoch ---------------------------------------------------------
class ShuffledBatches:
    """A plain iterable loader (no DataLoader, no state_dict()): each epoch yields its fixed batches in an
    order drawn from torch's global RNG. `served` records every batch it yields. It has no length, as a
    generator-backed stream (`SizedBatches` has one)."""

    def __init__(self, n_batches: int = 6, batch_size: int = 4) -> None:
        x, y = make_regression_data(n_batches * batch_size, seed=3)
        ids = torch.arange(n_batches * batch_size)
        self.batches = [
            (ids[i : i + batch_size], x[i : i + batch_size], y[i : i + batch_size])
            for i in range(0, len(ids), batch_size)
        ]
        self.served: list[int] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in torch.randperm(len(self.batches)).tolist():
            self.served.append(i)
            yield self.batches[i]


class SizedBatches(ShuffledBatches):
    def __len__(self) -> int:
        return len(self.batches)


class StreamTrainer(TinyTrainer):
    """Trains on a `ShuffledBatches`; `seen` holds `(batch_idx, sample ids)` of every step."""

    def __init__(self, config: Any, sized: bool) -> None:
        super().__init__(config, n_val=0)
        self.sized = sized
        self.seen: list[tuple[int, list[int]]] = []

    def configure_dataloaders(self) -> tuple[Any, None]:
        return (SizedBatches() if self.sized else ShuffledBatches()), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids, x, y = batch
        self.seen.append((batch_idx, ids.tolist()))
        return {"loss": F.mse_loss(self.model(x), y)}


@pytest.mark.parametrize("sized", [True, False], ids=["with-len", "without-len"])
def test_plain_iterable_resumed_mid_epoch_trains_exactly_the_batches_not_yet_trained(tmp_path, sized):
    ckpt = tmp_path / "mid.ckpt"
    a = StreamTrainer(quiet_config(tmp_path / "a", n_epochs=2), sized)
    a.fit()
    b = StreamTrainer(quiet_config(tmp_path / "b", n_epochs=2, callbacks=[SaveThenCrash(ckpt, 1, 2)]), sized)
    with pytest.raises(Crash):
        b.fit()
    assert [i for i, _ in b.seen] == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    c = StreamTrainer(quiet_config(tmp_path / "b", n_epochs=2), sized)
    c.fit(ckpt_path=ckpt)

    assert c.seen == a.seen[9:]  # batches 3, 4, 5 of epoch 1: same samples, same batch_idx
    assert b.seen + c.seen == a.seen
    loader = c._train_loader_raw
    assert isinstance(loader, ShuffledBatches)
    assert loader.served == a._train_loader_raw.served[6:]  # epoch 1's order again; 3 batches read, not trained
    assert c.global_step == a.global_step == 12
    _assert_same_weights(c, a)

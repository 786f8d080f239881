"""Training longer is exact: a run that `max_steps` (or `should_stop`) ends inside an epoch, continued with
`fit(ckpt_path="last")` by a new trainer with a larger `max_steps`, ends with the weights, learning rate and
counters of one uninterrupted run, and the epoch end hooks fired as often.

The contract: a stop before the epoch's last batch is not an epoch end. No `on_train_epoch_end`, no
epoch-interval scheduler step, no epoch counted (`current_epoch` stays); the final checkpoint is a mid-epoch one
(like a SIGTERM checkpoint), so the continued run trains the rest of that epoch, then ends it.
`on_train_end` and `on_fit_end` still fire.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_regression_data, quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from dream_trainer import Callback, DreamTrainer
from dream_trainer.data import InfiniteSampler, ShardedIterable

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons: the same kernels

X, Y = make_regression_data(16)  # 4 batches of 4 per epoch


class Rows(ShardedIterable):
    """An endless stream (a new reshuffled pass after each one) of the regression rows, 4 shards of 4."""

    def num_shards(self) -> int:
        return 4

    def read_shard(self, index: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(index * 4 + start, index * 4 + 4):
            yield X[k], Y[k]


def shuffled_loader() -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True)


def endless_sampler_loader() -> StatefulDataLoader:
    data = TensorDataset(X, Y)
    return StatefulDataLoader(data, batch_size=4, sampler=InfiniteSampler(data, seed=0))


def endless_stream_loader() -> StatefulDataLoader:
    return StatefulDataLoader(Rows(shuffle=True, seed=0, infinite=True), batch_size=4)


def ordered_loader() -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=4)


class EpochHooks(Callback):
    """Counts the hooks whose firing the contract decides."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.epochs_ended: list[int] = []

    def on_train_epoch_end(self, trainer: Any) -> None:
        self.counts["on_train_epoch_end"] += 1
        self.epochs_ended.append(trainer.current_epoch)

    def on_train_end(self, trainer: Any) -> None:
        self.counts["on_train_end"] += 1

    def on_fit_end(self, trainer: Any) -> None:
        self.counts["on_fit_end"] += 1


class StopAt(Callback):
    """Sets `trainer.should_stop` once `global_step` reaches `step` (as a user's callback, or an early stop at a
    step-cadence validation, would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class Regression(DreamTrainer):
    """A linear model, SGD with momentum (its state must carry over too), an optional epoch-interval StepLR."""

    def __init__(self, config: Any, make_loader: Any, step_lr: bool = False) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.make_loader = make_loader
        self.step_lr = step_lr

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        if self.step_lr:  # scheduler_interval="epoch" (the default): one step per epoch end
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    def configure_dataloaders(self) -> tuple[Any, None]:
        return self.make_loader(), None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def run(
    root: Path,
    make_loader: Any,
    max_steps: int | None,
    *,
    ckpt_path: str | None = None,
    step_lr: bool = False,
    callbacks: tuple[Callback, ...] = (),
    **config: Any,
) -> tuple[Regression, EpochHooks]:
    """A new trainer (as a new process would build) fit once: `max_steps`, checkpointing on (`last.ckpt`)."""
    hooks = EpochHooks()
    cfg = quiet_config(
        root,
        n_epochs=config.pop("n_epochs", None),
        max_steps=max_steps,
        seed=0,
        enable_checkpointing=config.pop("enable_checkpointing", True),
        callbacks=[hooks, *callbacks],
        **config,
    )
    trainer = Regression(cfg, make_loader, step_lr=step_lr)
    trainer.fit(ckpt_path=ckpt_path)
    return trainer, hooks


def assert_same_run(continued: Regression, uninterrupted: Regression) -> None:
    for name, value in uninterrupted.model.state_dict().items():
        assert torch.equal(continued.model.state_dict()[name], value), name
    assert continued.optimizer.param_groups[0]["lr"] == uninterrupted.optimizer.param_groups[0]["lr"]
    assert (continued.global_step, continued.current_epoch) == (uninterrupted.global_step, uninterrupted.current_epoch)


# --- max_steps: a map-style shuffling loader, endless loaders, an epoch-interval scheduler ----------------------------
@pytest.mark.parametrize(
    ("make_loader", "first", "then", "cut_epoch", "epoch_ends"),
    [
        # 4 batches per epoch: step 6 is batch 1 of epoch 1, step 11 batch 2 of epoch 2. The cut run ends
        # epoch 0, the continued one epoch 1.
        (shuffled_loader, 6, 11, 1, (1, 1)),
        # No length: the one epoch never ends, so neither run ends it.
        (endless_sampler_loader, 6, 11, 0, (0, 0)),
        (endless_stream_loader, 6, 11, 0, (0, 0)),
    ],
    ids=["map-style-shuffled", "endless-InfiniteSampler", "endless-ShardedIterable"],
)
def test_training_longer_after_a_max_steps_cut_is_one_uninterrupted_run(
    tmp_path: Path, make_loader: Any, first: int, then: int, cut_epoch: int, epoch_ends: tuple[int, int]
) -> None:
    cut, cut_hooks = run(tmp_path / "a", make_loader, first)
    # The cut is not an epoch end: the epoch stays, its end hooks do not fire; the run's end hooks do.
    assert (cut.global_step, cut.current_epoch) == (first, cut_epoch)
    assert cut_hooks.counts == Counter(on_train_epoch_end=epoch_ends[0], on_train_end=1, on_fit_end=1)

    continued, continued_hooks = run(tmp_path / "a", make_loader, then, ckpt_path="last")
    uninterrupted, uninterrupted_hooks = run(tmp_path / "b", make_loader, then)

    assert_same_run(continued, uninterrupted)
    assert continued.global_step == then
    # The cut epoch ended once, in the continued run, where the uninterrupted run ended it.
    ended = cut_hooks.counts["on_train_epoch_end"] + continued_hooks.counts["on_train_epoch_end"]
    assert ended == uninterrupted_hooks.counts["on_train_epoch_end"] == sum(epoch_ends)
    assert cut_hooks.epochs_ended + continued_hooks.epochs_ended == uninterrupted_hooks.epochs_ended


def test_an_epoch_interval_scheduler_does_not_step_at_a_max_steps_cut(tmp_path: Path) -> None:
    cut, cut_hooks = run(tmp_path / "a", ordered_loader, 6, step_lr=True)
    # Epoch 0 ended (one halving); the cut inside epoch 1 is not an epoch end.
    assert cut.optimizer.param_groups[0]["lr"] == 0.005
    assert cut.scheduler.last_epoch == 1
    assert (cut.current_epoch, cut_hooks.counts["on_train_epoch_end"]) == (1, 1)

    continued, _ = run(tmp_path / "a", ordered_loader, 10, ckpt_path="last", step_lr=True)
    uninterrupted, _ = run(tmp_path / "b", ordered_loader, 10, step_lr=True)
    assert_same_run(continued, uninterrupted)
    assert continued.optimizer.param_groups[0]["lr"] == 0.0025  # epochs 0 and 1 ended: two halvings
    assert continued.scheduler.last_epoch == uninterrupted.scheduler.last_epoch == 2

    # max_steps at an epoch's last batch (step 8) is that epoch's end: it steps the scheduler, counts the epoch.
    at_end, hooks = run(tmp_path / "c", ordered_loader, 8, step_lr=True)
    assert (at_end.current_epoch, hooks.epochs_ended, at_end.scheduler.last_epoch) == (2, [0, 1], 2)
    continued, _ = run(tmp_path / "c", ordered_loader, 10, ckpt_path="last", step_lr=True)
    assert_same_run(continued, uninterrupted)


# --- should_stop set inside an epoch: the same rule ---------------------------------------------------------------
def test_should_stop_inside_an_epoch_is_not_an_epoch_end_and_the_run_continues_exactly(tmp_path: Path) -> None:
    # A callback stops the run at step 6 (batch 1 of epoch 1) of a 3-epoch run.
    stopped, stopped_hooks = run(
        tmp_path / "a", shuffled_loader, None, n_epochs=3, step_lr=True, callbacks=(StopAt(6),)
    )
    assert (stopped.global_step, stopped.current_epoch) == (6, 1)
    assert stopped_hooks.counts == Counter(on_train_epoch_end=1, on_train_end=1, on_fit_end=1)
    assert stopped.scheduler.last_epoch == 1

    # Continued without the stopping callback: the rest of epoch 1, then epoch 2, as if it had never stopped.
    continued, continued_hooks = run(tmp_path / "a", shuffled_loader, None, ckpt_path="last", n_epochs=3, step_lr=True)
    uninterrupted, uninterrupted_hooks = run(tmp_path / "b", shuffled_loader, None, n_epochs=3, step_lr=True)
    assert_same_run(continued, uninterrupted)
    assert (continued.global_step, continued.current_epoch) == (12, 3)
    assert stopped_hooks.epochs_ended + continued_hooks.epochs_ended == uninterrupted_hooks.epochs_ended == [0, 1, 2]


def test_should_stop_inside_an_accumulation_window_keeps_the_window(tmp_path: Path) -> None:
    # 2 micro-batches per step, 2 steps per epoch; stopping after batch 2 of epoch 0 (the first micro-batch of
    # step 2) leaves its gradient accumulated: the continued run completes that step with it.
    class StopAtBatch(Callback):
        def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2 and trainer.current_epoch == 0:
                trainer.should_stop = True

    common: dict[str, Any] = {"n_epochs": 2, "gradient_accumulation_steps": 2}
    stopped, hooks = run(tmp_path / "a", shuffled_loader, None, callbacks=(StopAtBatch(),), **common)
    assert (stopped.global_step, stopped.current_epoch, hooks.counts["on_train_epoch_end"]) == (1, 0, 0)
    continued, _ = run(tmp_path / "a", shuffled_loader, None, ckpt_path="last", **common)
    uninterrupted, _ = run(tmp_path / "b", shuffled_loader, None, **common)
    assert_same_run(continued, uninterrupted)
    assert continued.global_step == 4


# --- what the run leaves behind -----------------------------------------------------------------------------------
def test_the_final_checkpoint_of_a_cut_resumes_inside_the_epoch(tmp_path: Path) -> None:
    cut, _ = run(tmp_path, shuffled_loader, 6)
    last = torch.load(cut.checkpoint_dir / "last.ckpt", weights_only=True)
    assert last["counters"]["resume_epoch"] == 1 and last["counters"]["current_epoch"] == 1
    assert last["data"]["epoch"] == 1 and last["data"]["batches_done"] == 2
    assert (cut.checkpoint_dir / "epoch=1-step=6.ckpt").exists()  # named after the epoch it was written in


def test_a_checkpoint_saved_after_fit_returns_continues_the_cut_epoch(tmp_path: Path) -> None:
    # A checkpoint the user writes after fit() returns is the same mid-epoch resume record.
    cut, _ = run(tmp_path / "a", shuffled_loader, 6, enable_checkpointing=False)
    cut.save_checkpoint(tmp_path / "after.ckpt")
    continued, _ = run(tmp_path / "c", shuffled_loader, 11, ckpt_path=str(tmp_path / "after.ckpt"))
    uninterrupted, _ = run(tmp_path / "b", shuffled_loader, 11)
    assert_same_run(continued, uninterrupted)


def test_a_second_fit_of_the_same_trainer_continues_the_unfinished_epoch(tmp_path: Path) -> None:
    # In one process: the run stopped inside epoch 1; clearing should_stop and calling fit() again trains the
    # rest of that epoch, not the whole epoch again (nor the next one).
    stop = StopAt(6)
    trainer, hooks = run(tmp_path / "a", shuffled_loader, None, n_epochs=3, step_lr=True, callbacks=(stop,))
    stop.step, trainer.should_stop = 10**9, False
    trainer.fit()
    uninterrupted, uninterrupted_hooks = run(tmp_path / "b", shuffled_loader, None, n_epochs=3, step_lr=True)
    assert_same_run(trainer, uninterrupted)
    assert hooks.epochs_ended == uninterrupted_hooks.epochs_ended == [0, 1, 2]


def test_a_checkpoint_that_carries_cut_at_still_loads_and_continues_silently(tmp_path: Path, recwarn: Any) -> None:
    # Development versions wrote counters["cut_at"] (and warned on a resume that trained further); nothing reads
    # it now: such a checkpoint, written at the end of the epoch it cut, continues from the next epoch.
    cut, _ = run(tmp_path / "a", ordered_loader, 3, enable_checkpointing=False)
    state = cut.state_dict()
    state["counters"].update(cut_at=[3, 4], resume_epoch=1, current_epoch=1)
    state["data"].update(batches_done=0, epoch_rng=None)
    torch.save(state, tmp_path / "old.ckpt")
    continued, hooks = run(tmp_path / "c", ordered_loader, 6, ckpt_path=str(tmp_path / "old.ckpt"))
    assert (continued.global_step, continued.current_epoch, hooks.epochs_ended) == (6, 1, [])
    assert not [w for w in recwarn if "max_steps ended" in str(w.message)]

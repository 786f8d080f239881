"""Exact mid-epoch resume of the training data (DESIGN.md, Checkpoints; dream_trainer/utils/data_resume.py).

Every test runs the same recipe three times:

- A trains uninterrupted and records the sample ids of every step;
- B writes a checkpoint from a callback (mid-epoch unless said otherwise) and then "crashes";
- C is a fresh trainer in a scrambled process (other torch/python RNG state, `seed=None` so setup does
  not re-seed) that resumes from B's checkpoint.

B's ids followed by C's ids must be A's ids, C must read from the dataset exactly the samples it
trains on (the skipped batches are never read), and C's final weights must be bit-identical to A's.
The model has dropout and most loaders shuffle, so any RNG that is not restored shows up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_regression_data, quiet_config
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from dream_trainer import Callback, CheckpointError, DreamTrainer

# The resumed run sets seed=None on purpose (see `_resume`); loading then warns about exactly that
# difference. Any other difference between checkpoint and trainer still warns.
pytestmark = pytest.mark.filterwarnings(
    # (":" separates the fields of a filter, hence "\\x3a" for the colons of the message.)
    r"ignore:loading a checkpoint that differs from this trainer\x3a seed\x3a 42 -> None$:UserWarning"
)

N_SAMPLES = 30  # batch_size 4 -> 8 batches per epoch, the last one short (2 samples)
BATCH = 4


# --- data ------------------------------------------------------------------------------------------
class IdDataset(Dataset):
    """Map-style dataset returning `(index, x, y)`; `reads[i]` counts how often sample `i` was read.

    `reads` lives in shared memory so reads made in (forked) loader workers are counted too. An index
    may also be a list of indices (for samplers that yield whole batches with `batch_size=None`).
    """

    def __init__(self, n: int = N_SAMPLES) -> None:
        self.x, self.y = make_regression_data(n, seed=7)
        self.reads = torch.zeros(n, dtype=torch.long).share_memory_()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(index, dtype=torch.long)
        flat = idx.reshape(-1)
        self.reads.index_add_(0, flat, torch.ones_like(flat))
        return idx, self.x[idx], self.y[idx]


class PreBatchedSampler(Sampler):
    """Yields whole batches of indices from a permutation drawn from torch's global RNG."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n = n
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        perm = torch.randperm(self.n).tolist()
        for i in range(0, self.n, self.batch_size):
            yield perm[i : i + self.batch_size]

    def __len__(self) -> int:
        return (self.n + self.batch_size - 1) // self.batch_size


class IdStream(IterableDataset):
    """Iterable-style version of `IdDataset` (in order); it cannot skip to a batch."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        self.base = IdDataset(n)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in range(len(self.base)):
            yield self.base[i]


class StatefulListLoader:
    """A loader over a fixed list of batches that saves and restores its position itself, in the
    manner of torchdata's StatefulDataLoader: `iter()` starts a new epoch unless `load_state_dict`
    was called just before, in which case it continues from the saved position."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self._yielded = 0
        self._resume_at: int | None = None
        self.loaded_states: list[dict[str, int]] = []
        self.served: list[int] = []  # index of every batch handed out, in order

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        start = self._resume_at or 0
        self._resume_at = None
        self._yielded = start
        for i in range(start, len(self.batches)):
            self._yielded = i + 1
            self.served.append(i)
            yield self.batches[i]

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded_states.append(dict(state))
        self._resume_at = int(state["yielded"])


LoaderFactory = Callable[[Any], Any]


def _workers(n: int) -> dict[str, Any]:
    return {"num_workers": n, "multiprocessing_context": "fork", "persistent_workers": False} if n else {}


LOADERS: dict[str, LoaderFactory] = {
    "sequential": lambda ds: DataLoader(ds, batch_size=BATCH),
    "shuffle": lambda ds: DataLoader(ds, batch_size=BATCH, shuffle=True),
    "shuffle_generator": lambda ds: DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    ),
    "distributed_sampler": lambda ds: DataLoader(
        ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
    ),
    "batch_sampler": lambda ds: DataLoader(
        ds, batch_sampler=BatchSampler(RandomSampler(ds), batch_size=BATCH, drop_last=False)
    ),
    "prebatched_batch_size_none": lambda ds: DataLoader(ds, batch_size=None, sampler=PreBatchedSampler(len(ds), BATCH)),
    "shuffle_2_workers": lambda ds: DataLoader(ds, batch_size=BATCH, shuffle=True, **_workers(2)),
    "shuffle_generator_2_workers": lambda ds: DataLoader(
        ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5), **_workers(2)
    ),
    "distributed_sampler_2_workers": lambda ds: DataLoader(
        ds,
        batch_size=BATCH,
        sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3),
        **_workers(2),
    ),
}


# --- trainer ---------------------------------------------------------------------------------------
class IdTrainer(DreamTrainer):
    """Records the sample ids of every training step (`seen`, one list per step)."""

    def __init__(
        self,
        config: Any,
        make_loader: LoaderFactory = LOADERS["shuffle"],
        dataset: Any = None,
        optimizer: str = "adamw",
        scheduler: bool = False,
    ) -> None:
        super().__init__(config)
        self.make_loader = make_loader
        self.dataset = IdDataset() if dataset is None else dataset
        self.optimizer_kind = optimizer
        self.use_scheduler = scheduler
        self.seen: list[list[int]] = []

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        if self.optimizer_kind == "sgd":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        if self.use_scheduler:
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    def configure_dataloaders(self) -> tuple[Any, None]:
        return self.make_loader(self.dataset), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        ids, x, y = batch
        self.seen.append(ids.reshape(-1).tolist())
        return {"loss": F.mse_loss(self.model(x), y)}


class Crash(Exception):
    """Stands for the process dying right after a checkpoint was written."""


class CrashAfterBatch(Callback):
    """Writes a checkpoint in `on_train_batch_end` of batch `batch_idx` of epoch `epoch`, then crashes."""

    def __init__(self, path: Path, epoch: int, batch_idx: int) -> None:
        self.path = path
        self.epoch = epoch
        self.batch_idx = batch_idx

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)
            raise Crash(f"crash after epoch {self.epoch} batch {batch_idx}")


class CrashAtEpochEnd(Callback):
    """Writes a checkpoint in `on_train_epoch_end` of epoch `epoch`, then crashes."""

    def __init__(self, path: Path, epoch: int) -> None:
        self.path = path
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: Any) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            raise Crash(f"crash at the end of epoch {self.epoch}")


def _scramble_process_rng() -> None:
    """A fresh process: nothing of A's or B's RNG state may carry over to the resumed run."""
    torch.manual_seed(999)
    random.seed(999)


def _run_uninterrupted(tmp_path: Path, n_epochs: int = 3, **kwargs: Any) -> IdTrainer:
    trainer_kwargs, cfg = _split(kwargs)
    trainer = IdTrainer(quiet_config(tmp_path / "a", n_epochs=n_epochs, **cfg), **trainer_kwargs)
    trainer.fit()
    return trainer


def _run_crashing(tmp_path: Path, callback: Callback, n_epochs: int = 3, **kwargs: Any) -> IdTrainer:
    trainer_kwargs, cfg = _split(kwargs)
    trainer = IdTrainer(quiet_config(tmp_path / "b", n_epochs=n_epochs, callbacks=[callback], **cfg), **trainer_kwargs)
    with pytest.raises(Crash):
        trainer.fit()
    return trainer


def _resume(tmp_path: Path, path: Path, n_epochs: int = 3, via: str = "fit", **kwargs: Any) -> IdTrainer:
    """C: restarted in B's directory, in a scrambled process, with `seed=None` so that setup does not
    re-seed: every RNG state it trains with must come from the checkpoint."""
    trainer_kwargs, cfg = _split(kwargs)
    _scramble_process_rng()
    trainer = IdTrainer(quiet_config(tmp_path / "b", n_epochs=n_epochs, seed=None, **cfg), **trainer_kwargs)
    if via == "fit":
        trainer.fit(ckpt_path=path)
    else:
        trainer.load_checkpoint(path)
        trainer.fit()
    return trainer


_TRAINER_KWARGS = ("make_loader", "dataset", "optimizer", "scheduler")


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    trainer_kwargs = {k: v for k, v in kwargs.items() if k in _TRAINER_KWARGS}
    cfg = {k: v for k, v in kwargs.items() if k not in _TRAINER_KWARGS}
    if callable(trainer_kwargs.get("dataset")):  # a factory: every run gets its own dataset
        trainer_kwargs["dataset"] = trainer_kwargs["dataset"]()
    return trainer_kwargs, cfg


def _assert_same_weights(got: IdTrainer, want: IdTrainer) -> None:
    got_sd, want_sd = got.model.state_dict(), want.model.state_dict()
    assert list(got_sd) == list(want_sd)
    for name in want_sd:
        assert torch.equal(got_sd[name], want_sd[name]), f"{name} differs from the uninterrupted run"


def _reads_of(steps: list[list[int]], n: int = N_SAMPLES) -> torch.Tensor:
    flat = torch.tensor([i for step in steps for i in step], dtype=torch.long)
    return torch.bincount(flat, minlength=n)


def _per_epoch(steps: list[list[int]], epoch_len: int) -> list[list[list[int]]]:
    return [steps[i : i + epoch_len] for i in range(0, len(steps), epoch_len)]


# --- 1. every kind of map-style loader -------------------------------------------------------------
@pytest.mark.parametrize("kind", list(LOADERS))
def test_mid_epoch_resume_sees_exactly_the_remaining_batches(tmp_path, kind):
    make_loader = LOADERS[kind]
    ckpt = tmp_path / "mid.pt"
    a = _run_uninterrupted(tmp_path, make_loader=make_loader)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=2), make_loader=make_loader)
    c = _resume(tmp_path, ckpt, make_loader=make_loader)

    epoch_len = len(make_loader(IdDataset()))
    assert len(a.seen) == 3 * epoch_len
    assert len(b.seen) == epoch_len + 3  # epoch 0, then batches 0..2 of epoch 1
    if kind != "sequential":  # the test only means something if the order changes between epochs
        epochs = _per_epoch(a.seen, epoch_len)
        assert epochs[0] != epochs[1] != epochs[2]

    assert b.seen + c.seen == a.seen
    # The batches of epoch 1 done before the checkpoint were skipped as indices: C read from the
    # dataset exactly the samples it trained on, each once.
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[len(b.seen) :]))
    assert c.global_step == a.global_step == 3 * epoch_len
    assert c.current_epoch == a.current_epoch == 3
    _assert_same_weights(c, a)


@pytest.mark.parametrize("via", ["fit", "load_checkpoint"])
def test_resume_through_load_checkpoint_then_fit_matches_fit_with_ckpt_path(tmp_path, via):
    make_loader = LOADERS["shuffle_generator"]
    ckpt = tmp_path / "mid.pt"
    a = _run_uninterrupted(tmp_path, make_loader=make_loader)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=5), make_loader=make_loader)
    c = _resume(tmp_path, ckpt, via=via, make_loader=make_loader)
    assert b.seen + c.seen == a.seen
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[len(b.seen) :]))
    assert c.global_step == a.global_step
    _assert_same_weights(c, a)


def test_resume_on_the_last_batch_of_an_epoch_starts_the_next_epoch(tmp_path):
    # Batch 7 is the last (short) batch of epoch 1: the checkpoint is mid-epoch by position, but no
    # batch of that epoch is left.
    ckpt = tmp_path / "last.pt"
    a = _run_uninterrupted(tmp_path)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=7))
    c = _resume(tmp_path, ckpt)
    assert len(b.seen) == 16
    assert b.seen + c.seen == a.seen
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[16:]))
    assert c.global_step == a.global_step
    _assert_same_weights(c, a)


# --- 2. inside an accumulation window --------------------------------------------------------------
@pytest.mark.parametrize("batch_idx", [3, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_checkpoint_inside_accumulation_window_resumes_bit_exactly(tmp_path, batch_idx, optimizer):
    # 8 batches per epoch, windows [0, 1, 2], [3, 4, 5], [6, 7]: batches 3 and 4 are not window ends.
    ckpt = tmp_path / "window.pt"
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": 3, "optimizer": optimizer}
    a = _run_uninterrupted(tmp_path, **kwargs)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=batch_idx), **kwargs)
    assert b.global_step == 3 + 1  # epoch 0's three windows, then [0, 1, 2] of epoch 1
    c = _resume(tmp_path, ckpt, **kwargs)

    assert b.seen + c.seen == a.seen
    assert c.global_step == a.global_step == 9
    _assert_same_weights(c, a)
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[len(b.seen) :]))


def test_checkpoint_inside_an_fsdp_accumulation_window_resumes_bit_exactly(tmp_path):
    # FSDP2 on one process (a one-member group; the checkpoint a DCP directory). With its gradient sync off
    # inside the window FSDP2 kept the window's gradients to itself, out of the sharded `p.grad` the
    # checkpoint saves: the resumed run lost batches 3 and 4. tests/test_distributed.py runs it on 2 ranks.
    ckpt = tmp_path / "window.ckpt"
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": 3, "optimizer": "sgd", "strategy": "fsdp"}
    a = _run_uninterrupted(tmp_path, **kwargs)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=4), **kwargs)
    c = _resume(tmp_path, ckpt, **kwargs)
    assert (ckpt / ".metadata").is_file()
    assert b.seen + c.seen == a.seen
    assert c.global_step == a.global_step == 9
    _assert_same_weights(c, a)


@pytest.mark.parametrize(("saved", "resumed"), [("auto", "fsdp"), ("fsdp", "auto")])
def test_on_one_process_a_window_checkpoint_resumes_across_fsdp_and_plain_training(tmp_path, saved, resumed):
    # On one process an FSDP2 shard is the whole tensor: a window's gradients move between the layouts. (Both
    # strategies train this model to the same bits on one process.)
    ckpt = tmp_path / "window.ckpt"
    a = _run_uninterrupted(tmp_path, gradient_accumulation_steps=3, optimizer="sgd", strategy=resumed)
    kwargs: dict[str, Any] = {"gradient_accumulation_steps": 3, "optimizer": "sgd"}
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=4), strategy=saved, **kwargs)
    c = _resume(tmp_path, ckpt, strategy=resumed, **kwargs)
    assert b.seen + c.seen == a.seen
    _assert_same_weights(c, a)


def test_several_ranks_refuse_a_window_checkpoint_whose_gradients_are_laid_out_otherwise(tmp_path):
    # With several ranks, whole gradients (each DDP rank's own, not yet synchronised) and FSDP2's shards (of
    # the synchronised ones) do not convert: refused, naming what to do, before the window changes.
    from dream_trainer.accumulation import AccumulationWindow

    plain = IdTrainer(quiet_config(tmp_path / "plain", n_epochs=1, gradient_accumulation_steps=3))
    sharded = IdTrainer(quiet_config(tmp_path / "fsdp", n_epochs=1, gradient_accumulation_steps=3, strategy="fsdp"))
    for trainer in (plain, sharded):
        trainer.fit()
    entries = {}
    for name, trainer in (("whole", plain), ("sharded", sharded)):
        window = AccumulationWindow(3)
        window.advance(0, 8)
        entries[name] = window.entry(trainer.named_models())
        assert entries[name]["sharded"] == (name == "sharded")
    for saved, trainer in (("whole", sharded), ("sharded", plain)):
        checkpoint = {"window": entries[saved], "window_per_rank": [entries[saved]] * 2}
        window = AccumulationWindow(3)
        with pytest.raises(CheckpointError, match="resume it with the strategy that wrote it") as info:
            window.load_state_dict(checkpoint, trainer.named_models(), rank=1, world_size=2)
        assert f"inside an accumulation window with {saved}" in str(info.value)
        assert window.pos == 0  # nothing was loaded
        window.load_state_dict(checkpoint, trainer.named_models(), rank=0, world_size=1)  # one process: fine
        assert window.pos == 1


def test_an_earlier_versions_fsdp_window_checkpoint_without_gradients_warns_that_it_is_not_exact(tmp_path):
    # Before FSDP2 synchronised every micro-batch, its window checkpoints held no gradients (FSDP2 kept them):
    # such an entry (no "sharded" key, a backward noted, no gradient for a model that trains) still loads, and
    # says the continuation differs. An earlier version's entry that holds its gradients loads in silence.
    import warnings

    from dream_trainer.accumulation import AccumulationWindow

    trainer = IdTrainer(quiet_config(tmp_path, n_epochs=1, gradient_accumulation_steps=3))
    trainer.fit()
    window = AccumulationWindow(3)
    window.advance(0, 8)
    window.note_backward()
    entry = window.entry(trainer.named_models())
    assert entry["grads"]["model"]  # the trained model's gradients
    old = {k: v for k, v in entry.items() if k != "sharded"}
    lost = {**old, "grads": {"model": {}}}
    with pytest.warns(UserWarning, match="saved none of the window's gradients") as caught:
        AccumulationWindow(3).load_state_dict({"window": lost}, trainer.named_models())
    assert caught[0].filename == __file__  # attributed to the code that loads it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AccumulationWindow(3).load_state_dict({"window": old}, trainer.named_models())


# --- 3. checkpoints at epoch boundaries ------------------------------------------------------------
def test_checkpoint_from_on_train_epoch_end_resumes_at_next_epoch_without_replay(tmp_path):
    ckpt = tmp_path / "epoch_end.pt"
    a = _run_uninterrupted(tmp_path)
    b = _run_crashing(tmp_path, CrashAtEpochEnd(ckpt, epoch=1))
    assert len(b.seen) == 16  # epochs 0 and 1 complete
    c = _resume(tmp_path, ckpt)

    assert len(c.seen) == 8  # only epoch 2: no batch of epoch 1 replayed
    assert b.seen + c.seen == a.seen
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[16:]))
    assert c.global_step == a.global_step == 24
    assert c.current_epoch == 3
    _assert_same_weights(c, a)


def test_checkpoint_from_on_train_epoch_end_with_epoch_scheduler_resumes_bit_exactly(tmp_path):
    # The epoch-interval scheduler steps after on_train_epoch_end: a checkpoint written there, which
    # resumes at the next epoch, must still leave the next epoch with the stepped learning rate.
    ckpt = tmp_path / "epoch_end.pt"
    a = _run_uninterrupted(tmp_path, scheduler=True)
    b = _run_crashing(tmp_path, CrashAtEpochEnd(ckpt, epoch=1), scheduler=True)
    c = _resume(tmp_path, ckpt, scheduler=True)

    assert b.seen + c.seen == a.seen
    assert c.scheduler.last_epoch == a.scheduler.last_epoch == 3
    assert c.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    _assert_same_weights(c, a)


@pytest.mark.parametrize("scheduler", [False, True])
def test_checkpoint_after_fit_continues_with_next_epoch_when_n_epochs_grows(tmp_path, scheduler):
    a = _run_uninterrupted(tmp_path, n_epochs=3, scheduler=scheduler)
    b = IdTrainer(quiet_config(tmp_path / "b", n_epochs=2), scheduler=scheduler)
    b.fit()
    ckpt = b.save_checkpoint(tmp_path / "done.pt")
    c = _resume(tmp_path, ckpt, n_epochs=3, scheduler=scheduler)

    assert len(c.seen) == 8  # epoch 2 only
    assert b.seen + c.seen == a.seen
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[16:]))
    assert c.global_step == a.global_step == 24
    assert c.current_epoch == 3
    _assert_same_weights(c, a)


# --- 4. iterable-style datasets ---------------------------------------------------------------------
def test_iterable_dataset_resume_warns_and_restarts_the_epoch(tmp_path):
    def make_loader(stream: IdStream) -> DataLoader:
        return DataLoader(stream, batch_size=BATCH)

    kwargs: dict[str, Any] = {"make_loader": make_loader, "dataset": IdStream}
    ckpt = tmp_path / "mid.pt"
    a = _run_uninterrupted(tmp_path, **kwargs)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=2), **kwargs)
    assert len(b.seen) == 8 + 3
    with pytest.warns(UserWarning, match="IterableDataset"):
        c = _resume(tmp_path, ckpt, **kwargs)

    # Epoch 1 is seen again from its first batch, then epoch 2.
    assert c.seen == a.seen[8:]
    assert c.current_epoch == 3


# --- 5. loaders with their own state_dict ----------------------------------------------------------
def _stateful_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    ds = IdDataset()
    perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(11))
    return [ds[perm[i : i + BATCH]] for i in range(0, N_SAMPLES, BATCH)]


def test_loader_with_own_state_dict_is_restored_through_it(tmp_path):
    def make_loader(_: Any) -> StatefulListLoader:
        return StatefulListLoader(_stateful_batches())

    ckpt = tmp_path / "mid.pt"
    a = _run_uninterrupted(tmp_path, make_loader=make_loader)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=2), make_loader=make_loader)
    c = _resume(tmp_path, ckpt, make_loader=make_loader)

    loader = c._train_loader_raw
    assert isinstance(loader, StatefulListLoader)
    assert loader.loaded_states == [{"yielded": 3}]  # restored through its own load_state_dict
    assert loader.served == list(range(3, 8)) + list(range(8))  # batches 0..2 of epoch 1 never served
    assert b.seen + c.seen == a.seen
    assert c.global_step == a.global_step
    _assert_same_weights(c, a)


def test_loader_with_own_state_dict_inside_accumulation_window(tmp_path):
    def make_loader(_: Any) -> StatefulListLoader:
        return StatefulListLoader(_stateful_batches())

    ckpt = tmp_path / "mid.pt"
    kwargs: dict[str, Any] = {"make_loader": make_loader, "gradient_accumulation_steps": 3}
    a = _run_uninterrupted(tmp_path, **kwargs)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=4), **kwargs)
    c = _resume(tmp_path, ckpt, **kwargs)
    assert b.seen + c.seen == a.seen
    assert c.global_step == a.global_step == 9
    _assert_same_weights(c, a)


# --- 6. limit_train_batches ------------------------------------------------------------------------
@pytest.mark.parametrize(("limit", "epoch_len"), [(5, 5), (0.5, 4)])
@pytest.mark.parametrize("kind", ["shuffle", "shuffle_generator"])
def test_limit_train_batches_keeps_epoch_length_after_mid_epoch_resume(tmp_path, limit, epoch_len, kind):
    kwargs: dict[str, Any] = {"make_loader": LOADERS[kind], "limit_train_batches": limit}
    ckpt = tmp_path / "mid.pt"
    a = _run_uninterrupted(tmp_path, **kwargs)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=1), **kwargs)
    c = _resume(tmp_path, ckpt, **kwargs)

    assert len(a.seen) == 3 * epoch_len
    assert len(b.seen) == epoch_len + 2
    assert len(c.seen) == (epoch_len - 2) + epoch_len  # the rest of epoch 1, then a full epoch 2
    assert b.seen + c.seen == a.seen
    assert torch.equal(c.dataset.reads, _reads_of(a.seen[len(b.seen) :]))
    assert c.global_step == a.global_step == 3 * epoch_len
    _assert_same_weights(c, a)


# --- 7. bf16 + dropout + AdamW + epoch scheduler + shuffle -----------------------------------------
@pytest.mark.parametrize("accumulation", [1, 3])
def test_bf16_adamw_step_lr_shuffle_resume_is_bit_exact(tmp_path, accumulation):
    kwargs: dict[str, Any] = {
        "mixed_precision": "bf16",
        "optimizer": "adamw",
        "scheduler": True,
        "gradient_accumulation_steps": accumulation,
        "make_loader": LOADERS["shuffle"],
    }
    ckpt = tmp_path / "mid.pt"
    a = _run_uninterrupted(tmp_path, **kwargs)
    b = _run_crashing(tmp_path, CrashAfterBatch(ckpt, epoch=1, batch_idx=4), **kwargs)
    c = _resume(tmp_path, ckpt, **kwargs)

    assert b.seen + c.seen == a.seen
    assert c.global_step == a.global_step
    assert c.scheduler.last_epoch == a.scheduler.last_epoch == 3
    assert c.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    _assert_same_weights(c, a)

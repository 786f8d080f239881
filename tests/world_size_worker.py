"""Resume at another world size (tests/test_world_sizes.py): the `world_sizes` part of the four-rank launch
(tests/four_rank_worker.py), run in its 4 processes after the others.

The part takes the processes through world sizes 1, 2, 3, 4, 2, 1 in turn: for each phase it destroys the
process group and creates one of the first W processes (on a store rank 0 hosts for the part); the others
wait for the phase to end. The same script trains at every size (`Run`): a map-style dataset of
`N_SAMPLES` samples that carry their ids, shuffled (`shuffle=True`: the trainer gives it a
DistributedSampler of `config.seed`; on one process a `GlobalOrderSampler` of the same seed, as
docs/distributed.md tells a one-process run that may continue on more), and a per-rank batch of
`GLOBAL_BATCH // W`, so that every optimizer step takes `GLOBAL_BATCH` samples at every size.

- `a<W>`: an uninterrupted run on W processes (W = 1, 2, 3, 4), which also writes a checkpoint at step
  `MID[W]` (mid-epoch) and trains on to the end: the reference and the writer.
- `c<N>to<M>`: a new run on M processes resuming `a<N>`'s checkpoint and training to the end
  (2 -> 1, 2 -> 3, 3 -> 2, 4 -> 2 with batches of 3 accumulated twice, 1 -> 2).
- `fsdp-a<W>`, `fsdp-c<N>to<M>`: the same under `strategy="fsdp"` (sharded checkpoints, read through
  torch.distributed.checkpoint by another number of ranks): writers on 2 and 4, resumes 2 -> 3, 4 -> 2.
- `stream-a<W>`, `stream-c<N>to<M>`: the same samples streamed, a `TokenDataset` (window i of the token file
  stands for sample i) shuffled with seed 0, read in each rank's process: writers on 1 to 4, resumes
  1 -> 2, 2 -> 3, 3 -> 2, 2 -> 1, 4 -> 2.
- `shards-a<W>`, `shards-c<N>to<M>`: the same samples in `SHARDS` files of `N_SAMPLES // SHARDS` (a `ShardList`
  of `.jsonl` files, shuffled with seed 0, read in each rank's process): on W ranks a step's samples are the next
  ones of each rank's files, so a resume on M reads the files as the W parts of the run's start
  (`dream_trainer.data.parts`). Writers on 1 to 4, resumes 1 -> 2, 2 -> 3, 3 -> 2, 2 -> 1, 4 -> 2.

Every training step records (global step, the ids of this rank's batch); after the fit the ranks gather
them, and rank 0 writes `<run>.pt`: the ledger (global step -> the sorted ids of its global batch, over all
ranks and micro-batches), the final weights and optimizer state, each epoch's logged mean loss
(`loss_epoch`), the world size and the warnings.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.data import GlobalOrderSampler, ShardList, TokenDataset

N_SAMPLES = 96
SHARDS = 24  # the `shards` runs' files (4 samples each: every world size 1-4 reads as many per rank)
SEQ_LEN = 4  # the `stream` runs' token windows
GLOBAL_BATCH = 12
EPOCHS = 2  # 8 steps an epoch, 16 in all
MID = {1: 5, 2: 5, 3: 11, 4: 11}  # the checkpoint's step: inside epoch 0 (5 of 8 steps) or epoch 1 (3 of 8)
WRITERS = (  # (kind, world size)
    *(("ddp", w) for w in (1, 2, 3, 4)),
    ("fsdp", 2),
    ("fsdp", 4),
    *(("stream", w) for w in (1, 2, 3, 4)),
    *(("shards", w) for w in (1, 2, 3, 4)),
)
RESUMES = (  # (kind, written on N, resumed on M, gradient_accumulation_steps on M)
    ("ddp", 1, 2, 1),
    ("ddp", 2, 3, 1),
    ("ddp", 3, 2, 1),
    ("ddp", 4, 2, 2),
    ("ddp", 2, 1, 1),
    ("fsdp", 2, 3, 1),  # a sharded checkpoint (torch.distributed.checkpoint) read by other ranks
    ("fsdp", 4, 2, 1),
    ("stream", 1, 2, 1),  # a TokenDataset read by each rank in its own process
    ("stream", 2, 3, 1),
    ("stream", 3, 2, 1),
    ("stream", 2, 1, 1),
    ("stream", 4, 2, 1),
    ("shards", 1, 2, 1),  # a ShardList of files of several samples, read as the writer's parts
    ("shards", 2, 3, 1),
    ("shards", 3, 2, 1),
    ("shards", 2, 1, 1),
    ("shards", 4, 2, 1),
)
PHASES = (1, 2, 3, 4, 2, 1)  # the world sizes, in turn; each phase runs what it can (its writers are done)


def name(strategy: str, written: int, resumed: int | None = None) -> str:
    """`a<N>` (a writer) or `c<N>to<M>` (a resume), `fsdp-` before either under FSDP."""
    prefix = "" if strategy == "ddp" else f"{strategy}-"
    return f"{prefix}a{written}" if resumed is None else f"{prefix}c{written}to{resumed}"


def _plan() -> list[list[tuple[str, int, int | None, int]]]:
    """Per phase, the runs it makes: (strategy, N, M or None, accumulation), writers first."""
    done: set[str] = set()
    plan = []
    for world in PHASES:
        runs: list[tuple[str, int, int | None, int]] = []
        for strategy, n in WRITERS:
            if n == world and name(strategy, n) not in done:
                runs.append((strategy, n, None, 1))
                done.add(name(strategy, n))
        for strategy, n, m, accumulation in RESUMES:
            if m == world and name(strategy, n) in done and name(strategy, n, m) not in done:
                runs.append((strategy, n, m, accumulation))
                done.add(name(strategy, n, m))
        plan.append(runs)
    return plan


PLAN = _plan()


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + i)
    x = torch.randn(4, generator=g)
    return x, x.sum(0, keepdim=True) * 0.5 + (i % 5) * 0.1


class Samples(Dataset):
    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return (i, *sample(i))


class Run(DreamTrainer):
    """The user's script, the same at every world size: the per-rank batch from the world size."""

    num_workers = 0  # the streams' loader workers

    def __init__(
        self, config: DreamTrainerConfig, *, global_order: bool = False, tokens: Path | None = None,
        shards: list[Path] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        self.global_order = global_order
        self.tokens = tokens
        self.shards = shards
        self.record: list[tuple[int, list[int]]] = []
        self.epoch_losses: list[float] = []

    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)

    def configure_dataloaders(self) -> Any:
        batch = GLOBAL_BATCH // (self.world_size * self.config.gradient_accumulation_steps)
        if self.tokens is not None:  # the same samples, streamed: window i of the token file is sample i
            stream = TokenDataset(self.tokens, seq_len=SEQ_LEN, shuffle=True, seed=0)
            return DataLoader(stream, batch_size=batch, num_workers=self.num_workers), None
        if self.shards is not None:  # the same samples in files: each line of a file is a sample's id
            files = ShardList(self.shards, shuffle=True, seed=0)
            return DataLoader(files, batch_size=batch, num_workers=self.num_workers), None
        if self.global_order:  # a one-process run that may continue on more processes
            return DataLoader(Samples(), batch_size=batch, sampler=GlobalOrderSampler(Samples(), seed=0)), None
        return DataLoader(Samples(), batch_size=batch, shuffle=True), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.tokens is not None:  # (x, y) windows of the token file: sample i's window begins with i x SEQ_LEN
            ids = batch[0][:, 0] // SEQ_LEN
            x, y = (torch.stack(t) for t in zip(*(sample(int(i)) for i in ids), strict=True))
        elif self.shards is not None:
            ids = batch
            x, y = (torch.stack(t) for t in zip(*(sample(int(i)) for i in ids), strict=True))
        else:
            ids, x, y = batch
        self.record.append((self.global_step, ids.tolist()))
        return F.mse_loss(self.model(x), y)


class SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.loop.step_ended:
            trainer.save_checkpoint(self.path)


class EpochLoss(Callback):
    """The epoch's mean training loss over all ranks, as logged (`loss_epoch`), at each epoch end."""

    def on_train_epoch_end(self, trainer: Any) -> None:
        trainer.epoch_losses.append(float(trainer.callback_metrics["loss_epoch"]))


def config(root: Path, **kw: Any) -> DreamTrainerConfig:
    return DreamTrainerConfig(
        seed=0, device="cpu", n_epochs=EPOCHS, root_dir=str(root), enable_progress_bar=False,
        enable_checkpointing=False, hang_timeout=60.0, **{**kw, "callbacks": [EpochLoss(), *kw.get("callbacks", [])]},
    )  # fmt: skip


class OneWorker(Run):
    """`Run` whose streams each rank reads with one loader worker (a DataLoader keeping no state of its own)."""

    num_workers = 1


def one_process_resume(root: Path, **data: Any) -> tuple[Run, Run, list[warnings.WarningMessage]]:
    """On one process, with one loader worker (`OneWorker`, `data`: `tokens=` or `shards=`): an uninterrupted
    run, a run that writes a checkpoint at step 5 and stops at 7, and a run resumed from that checkpoint.
    Gives the uninterrupted run, the resumed one and the warnings of its fit."""
    whole = OneWorker(config(root / "whole"), **data)
    whole.fit()
    mid = root / "mid.ckpt"
    OneWorker(config(root / "stopped", callbacks=[SaveAt(5, mid)], max_steps=7), **data).fit()
    resumed = OneWorker(config(root / "resumed"), **data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(ckpt_path=str(mid))
    return whole, resumed, caught


def _result(trainer: Run, caught: list[warnings.WarningMessage]) -> dict[str, Any]:
    records: list[list[tuple[int, list[int]]]] = [trainer.record]
    if dist.is_initialized():
        records = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(records, trainer.record)
    ledger: dict[int, list[int]] = {}
    for record in records:
        for step, ids in record:
            ledger.setdefault(step, []).extend(ids)
    model = getattr(trainer.model, "module", trainer.model)
    optimizer = trainer.optimizer.state_dict()
    return {
        "ledger": {step: sorted(ids) for step, ids in sorted(ledger.items())},
        "weights": {k: _whole(v) for k, v in model.state_dict().items()},
        "optimizer": {i: {k: _whole(v) for k, v in state.items()} for i, state in optimizer["state"].items()},
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "epoch_losses": trainer.epoch_losses,
        "warnings": [str(w.message) for w in caught],
    }


def _whole(value: Any) -> Any:
    """A tensor whole (FSDP2 holds DTensor shards: every rank calls this, a collective), detached."""
    if isinstance(value, torch.Tensor):
        return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return value


def _fit(out: Path, name: str, trainer: Run, ckpt_path: Path | None = None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ckpt_path=None if ckpt_path is None else str(ckpt_path))
    result = _result(trainer, caught)
    if int(os.environ["RANK"]) == 0:
        torch.save(result, out / f"{name}.pt")


def run_phase(out: Path, phase: int) -> None:
    """The runs of `phase` (`PLAN`), in this process (one of the phase's ranks)."""
    tokens = out / f"tokens-rank{os.environ['RANK']}.bin"  # each rank's copy (no rank waits for another's)
    if not tokens.exists():
        np.arange(N_SAMPLES * SEQ_LEN + 1, dtype=np.uint16).tofile(tokens)
    shards = shard_files(out / f"shards-rank{os.environ['RANK']}")
    for strategy, n, m, accumulation in PLAN[phase]:
        kw: dict[str, Any] = {"strategy": strategy} if strategy == "fsdp" else {}
        data: dict[str, Any] = {"tokens": tokens} if strategy == "stream" else {}
        if strategy == "shards":
            data = {"shards": shards}
        if m is None:  # a writer: its checkpoint at MID[n], and on to the end
            mid = out / f"{name(strategy, n)}-mid.ckpt"
            kw["callbacks"] = [SaveAt(MID[n], mid)]
            trainer = Run(config(out / "runs" / name(strategy, n), **kw), global_order=n == 1, **data)
            _fit(out, name(strategy, n), trainer)
        else:
            run_config = config(out / "runs" / name(strategy, n, m), gradient_accumulation_steps=accumulation, **kw)
            _fit(out, name(strategy, n, m), Run(run_config, **data), out / f"{name(strategy, n)}-mid.ckpt")


def shard_files(directory: Path) -> list[Path]:
    """`SHARDS` files of consecutive sample ids, one a line (each rank its own copy)."""
    per_file = N_SAMPLES // SHARDS
    paths = [directory / f"{k:03d}.jsonl" for k in range(SHARDS)]
    if not directory.exists():
        directory.mkdir(parents=True)
        for k, path in enumerate(paths):
            path.write_text("".join(f"{k * per_file + j}\n" for j in range(per_file)))
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(out: Path) -> None:
    """The part, in the launch's process group of 4 (which it leaves re-created, for the launch's end)."""
    rank = int(os.environ["RANK"])
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    store = dist.TCPStore("127.0.0.1", port[0], 4, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.destroy_process_group()
    try:
        for phase, world in enumerate(PHASES):
            if rank < world:
                os.environ["WORLD_SIZE"] = str(world)
                if world > 1:
                    group_store = dist.PrefixStore(f"phase{phase}", store)
                    dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world)
                try:
                    run_phase(out, phase)
                finally:
                    if dist.is_initialized():
                        dist.destroy_process_group()
            _wait_all(store, f"phase{phase}/done")
    finally:
        os.environ["WORLD_SIZE"] = "4"
        dist.init_process_group("gloo", store=dist.PrefixStore("end", store), rank=rank, world_size=4)


def _wait_all(store: dist.TCPStore, key: str) -> None:
    store.add(key, 1)
    deadline = time.monotonic() + 300
    while store.add(key, 0) < 4:
        if time.monotonic() > deadline:
            raise TimeoutError(f"world_sizes: the other processes did not reach {key}")
        time.sleep(0.05)

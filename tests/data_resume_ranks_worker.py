"""Mid-pass resume per data-parallel rank, and on another number of ranks (tests/test_data_resume_ranks.py).

    torchrun --standalone --nproc_per_node 2 tests/data_resume_ranks_worker.py --out-dir DIR [--from-one DIR1]
    python tests/data_resume_ranks_worker.py --out-dir DIR                                   # one process

For each loader kind it trains three runs in this process (group):
- A: uninterrupted, 2 epochs;
- B: the same run; at step STOP_AT it writes `mid.ckpt`, trains two more steps and stops (what a crash
  after a checkpoint loses);
- C: a new trainer that resumes from `mid.ckpt` and trains to the end.

Loader kinds, both torchdata `StatefulDataLoader(num_workers=2)`:
- `stream`: an IterableDataset that splits a per-epoch shuffled stream over data-parallel ranks (told by
  the trainer through `DataParallelAware`) and loader workers, and saves its absolute position in the
  stream, so every rank's (and worker's) state differs;
- `map`: a map-style dataset with `shuffle=True`, which the trainer shards with a DistributedSampler;
- `stream_fsdp` (with several processes only): `stream` again, the model sharded by FSDP2
  (`strategy="fsdp"`): the data state is per data-parallel rank under every strategy;
- `global` (one process only): a map-style dataset with `GlobalOrderSampler(seed=0)` and a batch of 8,
  the global batch of `map` on 2 ranks: the same samples per step as `map` on 2 ranks (`global_plain`,
  which the tests run themselves: the same with a plain `DataLoader` and no workers).

With several processes and `--from-one DIR1` (the one-process run's output), it also resumes DIR1's
`global-mid.ckpt` on these ranks with the `map` loader (batch 4 per rank: 8 per step again), writing
`from_one-rank<R>.pt` (ids, weights, warnings), and tries DIR1's `map-mid.ckpt` (one process, a
RandomSampler) here: the error it is refused with.

Every sample carries its id; the training step records the ids it trained on. Each rank writes
`<kind>-rank<R>.pt`: the ids per run, A's and C's final weights, the loader class. Rank 0 copies
`mid.ckpt` to `<kind>-mid.ckpt` (the world-size check loads it in another number of processes).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.data import DataParallelAware, GlobalOrderSampler
from dream_trainer.errors import CheckpointError

FSDP_KIND = "stream_fsdp"
N_SAMPLES = 96
BATCH = 4
GLOBAL_BATCH = 8  # samples per step of `map` on 2 ranks, of `global` on one
STOP_AT = 5
# The torchrun ranks start their loader workers from a forkserver (a process with one thread). Forked from a
# rank itself, a worker could deadlock as it starts on Python up to 3.11.7 (CPython gh-112275: the child
# inherits the interpreter's thread-list lock, held at that instant by another thread of the rank): seen
# under load in this launch, the watchdog naming rank 1 "fetching batch" at step 12, the start of epoch 2,
# its deadlocked worker left behind. One process (the test's own) forks them: its classes come from a file
# loaded by path, which a forkserver's children could not import.
WORKER_START = "forkserver" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
EPOCHS = 2


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(4, generator=g)
    return x, x.sum(0, keepdim=True) * 0.5 + (i % 7) * 0.1


class Stream(IterableDataset, DataParallelAware):
    """Positions 0..N-1 of an epoch's permutation; (rank r of W, worker w of K) reads positions
    p = r*K + w (mod W*K). State: the next position this worker reads (absolute, so it differs per rank)."""

    def __init__(self) -> None:
        self.rank, self.size, self.epoch = 0, 1, 0
        self.next_position: int | None = None

    def set_data_parallel(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        stride = self.size * workers
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(77 + self.epoch)).tolist()
        first = self.rank * workers + worker
        position = first if self.next_position is None else self.next_position
        self.next_position = None  # a loaded position applies to one iterator
        while position < N_SAMPLES:
            self.position = position + stride
            i = order[position]
            yield (i, *sample(i))
            position += stride

    def state_dict(self) -> dict[str, Any]:
        return {"position": getattr(self, "position", None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_position = state["position"]


class MapData(Dataset):
    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return (i, *sample(i))


class Run(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, kind: str, batch: int | None = None) -> None:
        super().__init__(config)
        self.kind = kind
        self.batch = batch or (GLOBAL_BATCH if kind.startswith("global") else BATCH)
        self.ids: list[list[int]] = []

    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def configure_dataloaders(self) -> Any:
        workers = {"num_workers": 2, "multiprocessing_context": WORKER_START}
        if self.kind == "persistent":  # `persistent_workers_last`: map-style, workers kept between epochs
            return StatefulDataLoader(MapData(), batch_size=self.batch, persistent_workers=True, **workers), None
        if self.kind.startswith("stream"):
            return StatefulDataLoader(Stream(), batch_size=self.batch, **workers), None
        if self.kind.startswith("global"):
            sampler = GlobalOrderSampler(MapData(), seed=0)
            if self.kind == "global_plain":  # a DataLoader, in this process: no state of its own
                return DataLoader(MapData(), batch_size=self.batch, sampler=sampler), None
            return StatefulDataLoader(MapData(), batch_size=self.batch, sampler=sampler, **workers), None
        return StatefulDataLoader(MapData(), batch_size=self.batch, shuffle=True, **workers), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        ids, x, y = batch
        self.ids.append(ids.tolist())
        return F.mse_loss(self.model(x), y)


class StopAfter(Callback):
    """B: write mid.ckpt at STOP_AT, train two more steps, stop."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == STOP_AT and trainer.loop.step_ended:
            trainer.save_checkpoint(self.path)
            trainer.ids_at_checkpoint = len(trainer.ids)
        if trainer.global_step == STOP_AT + 2:
            trainer.should_stop = True


def config(root: Path, **kw: Any) -> DreamTrainerConfig:
    kw.setdefault("n_epochs", EPOCHS)
    # device="cpu": gloo processes on a GPU machine too (two ranks cannot share its one GPU).
    # hang_timeout well inside the launch's 240 s: a rank that hangs (a loader worker deadlocked as it was
    # forked: see WORKER_START) is named, with where it is, by the watchdog's verdict in the launch's log.
    kw.setdefault("hang_timeout", 60.0)
    return DreamTrainerConfig(
        seed=0, device="cpu", root_dir=str(root), enable_progress_bar=False, enable_checkpointing=False, **kw
    )


def weights(trainer: Run) -> dict[str, torch.Tensor]:
    model = trainer.model
    model = getattr(model, "module", model)
    state = model.state_dict()
    # FSDP2 holds DTensor shards: compare whole tensors.
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def run_kind(kind: str, out_dir: Path) -> None:
    rank = int(os.environ.get("RANK", "0"))
    work = out_dir / "runs" / kind  # shared by the ranks, as on one machine
    strategy = {"strategy": "fsdp"} if kind == FSDP_KIND else {}
    a = Run(config(work / "a", **strategy), kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a.fit()
    mid = work / "mid.ckpt"  # global rank zero writes it, every rank reads it
    b = Run(config(work / "b", callbacks=[StopAfter(mid)], **strategy), kind)
    b.fit()
    c = Run(config(work / "c", **strategy), kind)
    c.fit(ckpt_path=str(mid))
    result = {
        "a_ids": a.ids,
        "b_ids": b.ids[: b.ids_at_checkpoint],  # type: ignore[attr-defined]
        "c_ids": c.ids,
        "a_weights": weights(a),
        "c_weights": weights(c),
        "loader_class": type(a._train_loader_raw).__name__,
        "world_size": a.world_size,
        "warnings": [(str(w.message), w.filename) for w in caught],
    }
    torch.save(result, out_dir / f"{kind}-rank{rank}.pt")
    if rank == 0 and mid.is_file():  # (FSDP2 writes a sharded checkpoint directory)
        shutil.copy(mid, out_dir / f"{kind}-mid.ckpt")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--from-one", help="the one-process run's output: its checkpoints resumed on these ranks")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir)
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several:
        # This launch hung twice in CI's lowest-versions run (torchdata 0.10), where no watchdog saw it (so
        # outside a fit's steps?). Well inside the test's 240 s, every thread's stack goes to stderr, which
        # the launch's log keeps, and the rank ends.
        import faulthandler

        faulthandler.dump_traceback_later(200, exit=True)
        # The forkserver imports these once; each loader worker it forks starts with them imported (else
        # every worker imports torch again: seconds per epoch).
        multiprocessing.set_forkserver_preload(
            ["__main__", "torch", "torch.utils.data", "torchdata.stateful_dataloader"]
        )
    for kind in ("stream", "map", *((FSDP_KIND,) if several else ("global",))):
        run_kind(kind, out_dir)
    whole_stream_on_every_rank(out_dir)
    if several and args.from_one:
        resume_from_one_process(out_dir, Path(args.from_one))
    if several:
        persistent_workers_last(out_dir)


def persistent_workers_last(out_dir: Path) -> None:
    """Last, with several processes: a fit whose loader keeps its workers between epochs, its trainer dropped
    when this function returns (as when a script's `main()` returns; the trainer is then garbage in reference
    cycles, which the exit's collection frees). Each rank writes when the fit ended
    (`persistent-end-rank<R>.txt`, time.time()): the test times the launch's end from there. The exit used to
    wait 5 s for each such worker."""
    rank = int(os.environ.get("RANK", "0"))
    Run(config(out_dir / "runs" / "persistent"), "persistent").fit()
    (out_dir / f"persistent-end-rank{rank}.txt").write_text(repr(time.time()))


def resume_from_one_process(out_dir: Path, one: Path) -> None:
    """One process's mid-epoch checkpoints continued on these ranks: `global` (exact), `map` (refused)."""
    rank = int(os.environ.get("RANK", "0"))
    work = out_dir / "runs" / "from_one"
    c = Run(config(work / "c"), "map")
    result: dict[str, Any] = {"world_size": c.world_size, "error": None, "refused": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:  # (every rank raises alike: the launch goes on, and the test shows the error)
            c.fit(ckpt_path=str(one / "global-mid.ckpt"))
            result.update(c_ids=c.ids, c_weights=weights(c))
        except CheckpointError as error:
            result["error"] = str(error)
    result["warnings"] = [str(w.message) for w in caught]
    try:
        Run(config(work / "refused"), "map").load_checkpoint(one / "map-mid.ckpt")
    except CheckpointError as error:
        result["refused"] = str(error)
    torch.save(result, out_dir / f"from_one-rank{rank}.pt")


class WholeStream(IterableDataset):
    """A stream that does not split itself over ranks: every rank reads all of it."""

    def __iter__(self) -> Any:
        for i in range(N_SAMPLES):
            yield (i, *sample(i))


class WholeStreamRun(Run):
    def configure_dataloaders(self) -> Any:
        return StatefulDataLoader(WholeStream(), batch_size=BATCH), None


def whole_stream_on_every_rank(out_dir: Path) -> None:
    """One epoch of a stream every rank reads whole: the warnings it gives, per rank."""
    rank = int(os.environ.get("RANK", "0"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        WholeStreamRun(config(out_dir / "runs" / "whole", n_epochs=1), "whole").fit()
    torch.save([(str(w.message), w.filename) for w in caught], out_dir / f"whole-rank{rank}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

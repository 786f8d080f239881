"""DistributedMixin: process identity, the process group, model wrapping and data sharding.

Launched by `torchrun` (one node or many) the trainer reads RANK / LOCAL_RANK / WORLD_SIZE (launched by
`srun` alone, it sets them first from SLURM's variables: `dream_trainer.utils.slurm`), joins the
process group (NCCL for CUDA tensors, gloo for CPU ones), wraps models with
`DistributedDataParallel` or FSDP2 `fully_shard`, gives plain DataLoaders a `DistributedSampler`,
and reduces logged metrics across ranks. On one process every collective is a no-op that returns
its input, so trainer code can call them unconditionally.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import time
import weakref
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dream_trainer.errors import MisconfigurationError
from dream_trainer.mixins.core import TrainerCore
from dream_trainer.parallel import resolve_strategy_name, strategy_class
from dream_trainer.parallel.round_store import round_prefix
from dream_trainer.parallel.strategy import Strategy
from dream_trainer.utils.modules import has_trainable_parameters
from dream_trainer.utils.warn import warn_user

_LIVE_TRAINERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _destroy_process_group() -> None:
    """At exit, while Python is intact: free the trainers that are garbage (their models hold the
    process groups: DDP reducers, FSDP2's mesh info), destroy the groups, then let gloo's worker
    threads finish. A worker that completed the last collective still has to drop its output tensors,
    which takes the GIL; on a loaded machine it may not have run yet, and if it first runs once the
    interpreter is finalizing, it is killed inside a C++ destructor and the process aborts
    ("terminate called without an active exception") after a successful run. The groups themselves
    cannot be freed here (torch.distributed.nn.functional keeps the world group in its defaults), so
    their threads are waited for instead."""
    if not dist.is_initialized():
        return
    _release_live_trainers()  # in its own frame: no local variable keeps the last trainer alive below
    gc.collect()
    # No barrier here: after a failure the other ranks may be gone, and waiting for them would hold
    # this process (and torchrun's failure detection) until the timeout.
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    _let_other_threads_finish()


def _let_other_threads_finish(limit: float = 1.0) -> None:
    """Sleep (the GIL released) until no other thread of this process is runnable, at most `limit` s.

    A thread waiting for the GIL wakes as soon as this one sleeps; one starved of a CPU shows as "R"
    in /proc. Without /proc (not Linux) one short sleep does the first part."""
    task = f"/proc/{os.getpid()}/task"
    me = str(threading.get_native_id())
    deadline = time.monotonic() + limit
    while True:
        time.sleep(0.005)
        try:
            others = [t for t in os.listdir(task) if t != me]
        except OSError:
            return
        if time.monotonic() > deadline or not any(_runnable(f"{task}/{t}/stat") for t in others):
            return


def _runnable(stat_path: str) -> bool:
    try:
        with open(stat_path) as f:
            # "pid (comm) S ...": the state follows the last ")" (comm may hold spaces or parentheses).
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False


def _release_live_trainers() -> None:
    for trainer in list(_LIVE_TRAINERS):
        with contextlib.suppress(Exception):
            trainer._release_wrappers()
        with contextlib.suppress(Exception):  # before the collector frees them (see stop_persistent_workers)
            trainer._stop_loader_workers()


def _with_sampler(loader: Any, sampler: Any) -> Any:
    """`loader` (a DataLoader that batches) rebuilt around `sampler`, its other settings kept. A
    StatefulDataLoader (torchdata) is rebuilt as one, so its state still resumes it exactly."""
    from torch.utils.data import DataLoader

    from dream_trainer.utils.data import loader_settings
    from dream_trainer.utils.data_resume import has_own_state

    loader_class = type(loader) if has_own_state(loader) else DataLoader
    return loader_class(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=loader.drop_last,
        **loader_settings(loader),
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


class DistributedMixin(TrainerCore):
    """Process identity, the device, the strategy, and collectives."""

    def _init_process_identity(self) -> None:
        self._adopt_launcher_ranks()
        self.world_size: int = _env_int("WORLD_SIZE", 1)
        self.global_rank: int = _env_int("RANK", 0)
        self.local_rank: int = _env_int("LOCAL_RANK", 0)
        self.device: torch.device = self._resolve_device(self.config.device)
        name = resolve_strategy_name(self.config.strategy, self.world_size, self.config)
        self.strategy: str = name
        """The resolved strategy name ("single", "ddp", "fsdp", ...); `parallel` is its object."""
        self.parallel: Strategy = strategy_class(name)(self.config, self.world_size, self.global_rank, self.device)
        """The strategy: wraps models, holds the meshes, runs collectives (see `dream_trainer.parallel`)."""
        self._sync_models: list[nn.Module] = []
        """Wrapped models whose gradient sync an accumulation window defers to its last micro-batch (DDP's:
        the strategy's `defers_gradient_sync`); set by `_bind_sync_models`."""
        self._kept_order_seed: int | None = None
        """The seed of the DistributedSampler order a run resumed on one process keeps (set by
        `_keep_order_seed` from the checkpoint; `_distribute_loader` gives a shuffling loader that order)."""
        self._rank_batches_unchecked: bool = False
        """True until the first batches of a training IterableDataset that does not say how it splits over
        ranks were compared across ranks (`_check_first_batches`)."""

    def _adopt_launcher_ranks(self) -> None:
        """`srun` started this process without torchrun: SLURM's variables say which rank it is, and the
        variables torchrun would have set are set from them (`dream_trainer.utils.slurm`). Once: the
        second trainer of a process finds torchrun's variables set and reads them."""
        from dream_trainer.utils.slurm import adopt_srun_tasks

        tasks = adopt_srun_tasks()
        if tasks is not None and tasks.rank == 0:
            print(
                f"dream_trainer: SLURM job {tasks.job_id} step {tasks.step_id}: {tasks.world_size} tasks from srun "
                f"(ranks from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); rendezvous at "
                f"{tasks.master_addr}:{tasks.master_port}",
                file=sys.stderr,
                flush=True,
            )

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in training."""
        return self.world_size > 1

    @property
    def is_global_zero(self) -> bool:
        """True on the process that writes logs, progress and checkpoints."""
        return self.global_rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank zero only (Lightning's `self.print`); the other ranks print nothing."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def _resolve_device(self, setting: str) -> torch.device:
        if setting == "auto":
            return self._gpu_of_this_rank(setting) if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(setting)
        if device.type == "cuda" and device.index is None:
            device = self._gpu_of_this_rank(setting)
        return device

    def _gpu_of_this_rank(self, setting: str) -> torch.device:
        """cuda:<local rank>. torchrun's processes of one node all see the same GPUs (LOCAL_WORLD_SIZE, which
        srun does not set: its tasks may each see their own GPU); more processes than GPUs would share one,
        which NCCL refuses only at the first collective ("Duplicate GPU detected")."""
        count, processes = torch.cuda.device_count(), _env_int("LOCAL_WORLD_SIZE", 1)
        if processes > count:
            raise MisconfigurationError(
                f"device={setting!r} gives each of this node's {processes} processes its own GPU, but {count} "
                f"CUDA device(s) are visible: launch at most {count} per node (torchrun --nproc_per_node "
                f"{count}), or set device='cpu' to train every process on the CPU (gloo)"
            )
        # The modulo: srun tasks bound to a GPU each (--gpus-per-task=1) see one device, whatever their local rank.
        return torch.device("cuda", self.local_rank % count)

    # --- the process group ------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        """Join the process group when launched on several processes (or for FSDP on one)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.parallel.needs_process_group and not dist.is_initialized():
            if self.world_size == 1 and "MASTER_ADDR" not in os.environ:
                # FSDP on a single process: a one-member group on a local store.
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
                os.environ.setdefault("RANK", "0")
                os.environ.setdefault("WORLD_SIZE", "1")
            # CPU collectives (metric reduction, object gathers, async saves) need gloo even on GPUs.
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            timeout = timedelta(seconds=self.config.process_group_timeout)
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun keeps one store for every start of the worker group (--max-restarts, an elastic
                # node joining): each start's keys under a prefix its ranks agree on, so a restarted group
                # never reads a dead start's addresses (see dream_trainer.parallel.round_store).
                host = os.environ.get("MASTER_ADDR", "127.0.0.1")
                store = dist.PrefixStore(round_prefix(store, rank, world, host, timeout), store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
            # Kept after fit() (sharded models need it to run, save or validate); destroyed at exit.
            atexit.register(_destroy_process_group)
        if dist.is_initialized():
            _LIVE_TRAINERS.add(self)
        self.parallel.setup()

    # --- models -----------------------------------------------------------------------------------
    def _distribute_model(self, model: nn.Module) -> nn.Module:
        """Wrap `model` for the strategy (models without trainable parameters stay as they are)."""
        if not has_trainable_parameters(model):
            return model
        return self.parallel.wrap_model(model, self)

    def apply_fully_shard(self, model: nn.Module) -> nn.Module:
        """Shard `model` with FSDP2 (strategy "fsdp", or "model_parallel" with dp_shard > 1). Default
        policy: every block of a `ModuleList`/`Sequential` container that holds parameters is its own
        unit, then the root, over the strategy's data-parallel mesh (the whole world for "fsdp"; the
        dp_shard (x cp) dimension, with dp_replicate as HSDP replicas, for a mesh). Override to choose.

        The mixed-precision policy follows `config.mixed_precision` (params in bf16/fp16 for compute,
        gradients reduced in fp32); `config.fsdp_cpu_offload` offloads parameters to the CPU.
        """
        from dream_trainer.parallel.data_parallel import apply_fsdp

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.config.mixed_precision or "")
        return apply_fsdp(
            model, self.parallel.fsdp_mesh, mp_param_dtype=dtype, cpu_offload=self.config.fsdp_cpu_offload
        )

    def _bind_sync_models(self) -> None:
        """At setup, once models are wrapped: the ones an accumulation window keeps from syncing before its
        last micro-batch (the strategy decides: DDP's; FSDP2 synchronises every micro-batch)."""
        self._sync_models = [m for _, m in self.named_models() if self.parallel.defers_gradient_sync(m)]
        self._window.sync_gradients(bool(self._sync_models))  # the window decides no_sync from it

    def _no_sync(self, models: list[nn.Module]) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient synchronisation for a backward inside an accumulation window."""
        return self.parallel.no_sync(models)

    # --- data -------------------------------------------------------------------------------------
    def _keep_order_seed(self, order: tuple[Any, ...] | None) -> bool:
        """A checkpoint being resumed on one process was written with the training order `order` (its
        `global_order`): a seeded DistributedSampler's is kept, so the run reads its samples in the same
        order as before at this world size too. True when that changes how the training loader is built."""
        seed = int(order[1]) if order and order[0] == "distributed" else None
        if self.is_distributed or seed is None or seed == self._kept_order_seed:
            return False
        self._kept_order_seed = seed
        return True

    def _distribute_loader(self, loader: Any, train: bool) -> Any:
        """Give a plain DataLoader a DistributedSampler (shuffle kept, seed from config), so each
        rank reads its own shard; loaders that already shard are returned unchanged. A dataset or
        sampler that is `DataParallelAware` is told its data-parallel rank and size instead. A
        `StatefulDataLoader` stays one (its state is saved per rank). On one process a shuffling
        training loader gets a `GlobalOrderSampler` instead of its `RandomSampler` where the run was
        resumed from a checkpoint shuffled by a DistributedSampler (`_keep_order_seed`)."""
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

        from dream_trainer.data.samplers import GlobalOrderSampler
        from dream_trainer.data.sharding import DataParallelAware
        from dream_trainer.utils.data_resume import is_random_sampler

        if not isinstance(loader, DataLoader):
            return loader
        if not self.is_distributed:
            kept = self._kept_order_seed
            if kept is None or not train or not is_random_sampler(loader.sampler):
                return loader
            if loader.batch_size is None or type(loader.batch_sampler).__name__ != "BatchSampler":
                return loader
            # The order of the DistributedSampler the checkpoint's ranks read, for one rank.
            return _with_sampler(loader, GlobalOrderSampler(loader.dataset, seed=kept, drop_last=loader.drop_last))  # type: ignore[arg-type]  # map-style: it had a RandomSampler
        dp_rank, dp_size = int(self.parallel.data_parallel_rank), int(self.parallel.data_parallel_size)
        samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
        aware = [x for x in (loader.dataset, *samplers) if isinstance(x, DataParallelAware)]
        for holder in aware:
            holder.set_data_parallel(dp_rank, dp_size)
        if aware or any(isinstance(s, DistributedSampler) for s in samplers):
            return loader
        if isinstance(loader.dataset, IterableDataset):
            # Whether the stream splits itself over ranks cannot be seen here; the first batches can
            # (`_check_first_batches`).
            if train:
                self._rank_batches_unchecked = True
            return loader
        if loader.batch_size is None or type(loader.batch_sampler).__name__ != "BatchSampler":
            warn_user("a DataLoader with a custom batch_sampler is not sharded automatically")
            return loader
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset,
            num_replicas=dp_size,
            rank=dp_rank,
            shuffle=is_random_sampler(loader.sampler),
            seed=self.config.seed or 0,
            drop_last=loader.drop_last and train,
        )
        return _with_sampler(loader, sampler)

    def _check_first_batches(self, batch: Any) -> None:
        """Once per fit, under data parallelism with an IterableDataset that does not declare how it
        splits over ranks: warn if every rank's first batch is the same (each rank reads the whole stream).
        Collective: the first batch of a fit only."""
        from dream_trainer.utils.tensors import fingerprint

        self._rank_batches_unchecked = False
        prints = self.all_gather_object(fingerprint(batch))
        if len(set(prints)) == 1:
            warn_user(
                f"every one of the {self.world_size} ranks read the same first batch from the training "
                "IterableDataset: each rank sees the same data. Split the stream over ranks (and loader "
                "workers): inherit dream_trainer.data.DataParallelAware, or see docs/data.md."
            )

    def _release_wrappers(self) -> None:
        """Replace DDP wrappers on the trainer by the modules they wrap (at exit)."""
        for name, model in self.named_models():
            if type(model).__name__ == "DistributedDataParallel":
                setattr(self, name, model.module)
        self._sync_models = []
        self._window.sync_gradients(False)

    def _freeze_preexisting_objects(self) -> bool:
        """Start of a distributed fit: move every object alive now to the collector's permanent
        generation (`gc.freeze`) until the end of fit; True if it did (then fit calls `gc.unfreeze`).

        The full collection in `_quiesce_distributed` walked all ~285k objects the imports of torch
        create: 0.16 s at the end of every distributed fit (commit e7d941b, 2 CPU cores, torch 2.13.0+cpu,
        2026-11-22), against 0.2 ms for what a fit of a small model allocates. The collector's own full
        passes during training skip them too, so ranks stall less often on each other. Left alone when
        the program froze objects itself.
        """
        if not self.is_distributed or gc.get_freeze_count():
            return False
        gc.freeze()
        return True

    def _quiesce_distributed(self) -> None:
        """End of fit: wait for every rank and drop finished collective handles while Python is fully
        alive (gloo threads freeing them during interpreter shutdown can abort the process)."""
        if self.is_distributed and dist.is_initialized():
            dist.barrier()
            gc.collect()  # the DDP wrappers were built in fit: not frozen, so this reaches them

    def _reduce_sums(self, packed: torch.Tensor) -> None:
        dist.all_reduce(packed)

    def _key_union(self, keys: list[str]) -> list[str]:
        """The sorted union of every rank's metric names. Usually every rank logs the same names: one
        all-reduce of a checksum confirms it; only when they differ are the names gathered."""
        digest = zlib.crc32("\0".join(keys).encode())
        extremes = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # SYNC: at logging points only
        if int(extremes[0]) == -int(extremes[1]) == digest:  # max == min: the same names everywhere
            return keys
        return sorted({k for ks in self.all_gather_object(keys) for k in ks})

    # --- collectives: identity on one process -----------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across processes in place ("sum", "mean", "max", "min") and return it."""
        return self.parallel.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The tensor of every process, in rank order (`[tensor]` on one process)."""
        return self.parallel.all_gather(tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable), in rank order (`[obj]` on one process)."""
        return self.parallel.all_gather_object(obj)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` as held by rank `src` (the object itself on one process)."""
        return self.parallel.broadcast(obj, src)

    def barrier(self) -> None:
        """Wait for every process (returns at once on one process)."""
        self.parallel.barrier()

"""Per-step fault tolerance across replica groups, on torchft: the `FaultTolerance` object a trainer holds.

Several copies of one job (replica groups, each a `torchrun` of its own) train one model together. Each step
they form a quorum through torchft's lighthouse; the step's global batch is dealt out among the quorum's
participants from one global sample cursor; their gradients are averaged across the groups; and the step
commits only when every participant finished it (`should_commit`). A replica that dies is left out of the
next quorum and the others go on; one that (re)starts receives the whole run state from a live peer (what a
checkpoint holds: weights, optimizer, loop position, RNG, loss scaler, the cursor, callbacks' state) and
continues in lockstep. See docs/fault-tolerance.md.

What lives here, one owner each:

- `FaultToleranceConfig`: the setting (`DreamTrainerConfig.fault_tolerance`), checked when the config is built.
- `SampleCursor`: where the run is in the epoch's global order (samples committed), and that order.
- `FaultTolerance`: the torchft `Manager`, the quorum of the coming step (`begin_step`), the commit
  (`commit`: the cross-group gradient average and `should_commit`), the heal (`_receive`), the ledger of
  committed global ranges (`fault_tolerance/samples.jsonl` in the run directory) and the counts run.json shows.
- `QuorumBatches`: the training loader the trainer iterates under fault tolerance: one batch per step, its
  samples assigned by that step's quorum.

torchft is imported only when a fit starts with the setting on (`pip install "dream-trainer[ft]"`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.errors import CheckpointError, ConfigError, MisconfigurationError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from dream_trainer.loop_state import LoopState


class StepNotCommitted(Exception):
    """The step's quorum did not commit it (a participant failed or left): nothing of it is counted, and the
    same global samples are trained again by the next quorum. Raised at the commit point, caught by the step."""


class Rejoined(Exception):
    """This replica fell behind (it was stopped, or its step failed) and healed from a live peer in the middle of
    training: the loop starts again from the received state. Caught by `fit()`."""


@dataclass
class FaultToleranceConfig:
    """`DreamTrainerConfig.fault_tolerance`: per-step fault tolerance across replica groups (torchft).

    Every replica group runs the same script and config, each under its own `torchrun`, with its own
    `replica_id` and its own run directory (`root_dir` or `run_name`). See docs/fault-tolerance.md.
    """

    lighthouse: str | None = None
    """The torchft lighthouse, "http://host:port". None: the TORCHFT_LIGHTHOUSE environment variable."""
    replica_id: str | None = None
    """This replica group's name, unique among the groups (e.g. "0", "1", ...). None: the REPLICA_GROUP_ID
    environment variable."""
    min_replicas: int = 1
    """A step commits only when at least this many replica groups took part in it."""
    timeout_s: float = 60.0
    """Seconds a cross-group collective, the commit vote or a heal's transfer may take before the step is
    dropped (a stopped replica costs the others this long, once)."""
    quorum_timeout_s: float = 60.0
    """Seconds to wait for a quorum at a step's start."""
    hostname: str | None = None
    """The address the other groups reach this group's manager and heal server at. None: this host's name."""

    def __post_init__(self) -> None:
        name = "fault_tolerance"
        if self.min_replicas < 1 or isinstance(self.min_replicas, bool):
            raise ConfigError(f"{name}.min_replicas = {self.min_replicas!r} is invalid: expected an int >= 1.")
        for field_name in ("timeout_s", "quorum_timeout_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name}.{field_name} = {value!r} is invalid: expected seconds > 0.")
        for field_name in ("lighthouse", "replica_id", "hostname"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name}.{field_name} = {value!r} is invalid: expected a non-empty str or None.")

    def resolved(self) -> tuple[str, str]:
        """(lighthouse, replica_id), from the fields or the environment; a missing one is a `ConfigError`."""
        lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        replica = self.replica_id or os.environ.get("REPLICA_GROUP_ID")
        if not lighthouse:
            raise ConfigError(
                "fault_tolerance.lighthouse is not set and TORCHFT_LIGHTHOUSE is empty: give the lighthouse's "
                "address, e.g. FaultToleranceConfig(lighthouse='http://127.0.0.1:29510') (docs/fault-tolerance.md)."
            )
        if not replica:
            raise ConfigError(
                "fault_tolerance.replica_id is not set and REPLICA_GROUP_ID is empty: give each replica group its "
                "own id, e.g. FaultToleranceConfig(replica_id='0') (docs/fault-tolerance.md)."
            )
        return lighthouse, replica


def as_fault_tolerance(value: Any) -> FaultToleranceConfig | None:
    """The setting as a `FaultToleranceConfig` (a dict from a YAML config is converted); None: off."""
    if value is None or isinstance(value, FaultToleranceConfig):
        return value
    if isinstance(value, Mapping):
        known = set(FaultToleranceConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"fault_tolerance has unknown field(s) {unknown}: expected some of {sorted(known)}.")
        return FaultToleranceConfig(**dict(value))
    raise ConfigError(
        f"fault_tolerance = {value!r} is invalid: expected None (off), a FaultToleranceConfig or a dict of its fields."
    )


class SampleCursor:
    """The global sample cursor: the epoch, and how many samples of that epoch's global order the committed
    steps covered. The order over all replica groups is one permutation per epoch (seeded by the run's seed
    and the epoch), so it does not depend on how many groups read it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def order(self, size: int, shuffle: bool, seed: int | None = None) -> torch.Tensor:
        """The epoch's order of the dataset's `size` indices: a `DistributedSampler`'s (and so a
        `GlobalOrderSampler`'s) over all ranks, a permutation seeded by `seed + epoch` (`seed`: the run's)."""
        if not shuffle:
            return torch.arange(size)
        generator = torch.Generator().manual_seed((self.seed if seed is None else seed) + self.epoch)
        return torch.randperm(size, generator=generator)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class FaultTolerance:
    """The torchft side of a fit: one per trainer with `fault_tolerance` set (see the module docstring).

    Given what it calls on the trainer (never the trainer): the loop, the run's state as a checkpoint holds it
    (`state_dict`, `load_state_dict`), the run directory (read when training starts) and run.json's writer.
    """

    def __init__(
        self,
        config: FaultToleranceConfig,
        seed: int,
        loop: LoopState,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        record_in_run: Callable[[str, Any], None],
    ) -> None:
        self.config = config
        self.cursor = SampleCursor(seed)
        self._loop = loop
        self._state_dict = state_dict
        self._load_state_dict = load_state_dict
        self._record_in_run = record_in_run
        self._manager: Any = None
        self._manager_state: dict[str, Any] | None = None
        self._group_rank = 0
        self._group_size = 1
        self._quorum_open = False  # a quorum was formed for the coming step and not used by a commit yet
        self._joining = False
        self._healed = False
        self._assigned: tuple[int, int, int] | None = None  # (start, end, participants) of the running step
        self._ledger: Any = None
        self.replica_id = ""
        self.counts: dict[str, int] = {"commits": 0, "redone": 0, "heals": 0, "participants": 0}
        self._last_participants = 0
        self.order_key: tuple[Any, ...] | None = None  # the training loader's global order (QuorumBatches sets it)

    # --- the run state (registered by the trainer as "fault_tolerance") ---------------------------------
    def checkpoint_entries(self) -> dict[str, Any]:
        manager = None if self._manager is None else self._manager.state_dict()
        return {"fault_tolerance": {"cursor": self.cursor.state_dict(), "manager": manager}}

    def load_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        entry = checkpoint.get("fault_tolerance")
        if not entry:
            return
        self.cursor.load_state_dict(entry["cursor"])
        manager = entry.get("manager")
        if manager is not None:
            if self._manager is not None:
                self._manager.load_state_dict(manager)
            else:  # a checkpoint loaded before training starts: the manager takes its step when it is made
                self._manager_state = dict(manager)

    # --- start and end ------------------------------------------------------------------------------
    def start(self, group_rank: int, group_size: int, run_dir: Path) -> None:
        """Join the replica groups: the torchft Manager of this process (at the start of training)."""
        if self._manager is not None:
            return
        # torchft's own Rust side logs every quorum and vote at INFO: warnings only, unless the user chose.
        os.environ.setdefault("RUST_LOG", "warn")
        manager_log = logging.getLogger("torchft.manager")
        if _no_flight_recorder_note not in manager_log.filters:
            manager_log.addFilter(_no_flight_recorder_note)
        from torchft import Manager, ProcessGroupGloo

        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise MisconfigurationError(
                "fault_tolerance: start each replica group with torchrun (it provides the group's store, "
                "MASTER_ADDR/MASTER_PORT), e.g. torchrun --nproc_per_node 1 train.py (docs/fault-tolerance.md)."
            )
        lighthouse, replica = self.config.resolved()
        cfg = self.config
        self.replica_id = replica
        self._group_rank, self._group_size = group_rank, group_size
        timeout = timedelta(seconds=cfg.timeout_s)
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            checkpoint_transport=_weights_only_transport()(timeout=timeout, num_chunks=0),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_replicas,
            # The quorum must be known before the step's batch is built (its samples depend on it): synchronous.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            rank=group_rank,
            world_size=group_size,
            lighthouse_addr=lighthouse,
            replica_id=replica,
            hostname=cfg.hostname or socket.gethostname(),
            # The replicas start from the same seed: no weight sync at step 0 (it would zero their first gradients).
            init_sync=False,
        )
        if self._manager_state is not None:
            self._manager.load_state_dict(self._manager_state)
            self._manager_state = None
        self._manager.register_state_dict_fn("dream_trainer", self._receive, self._state_dict)
        ledger = run_dir / "fault_tolerance"
        ledger.mkdir(parents=True, exist_ok=True)
        self._ledger = open(ledger / f"samples-rank{group_rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._say(f"replica group {replica!r} joining (lighthouse {lighthouse})")

    def close(self) -> None:
        """The end of the fit: the counts in run.json, the manager shut down."""
        if self._manager is None:
            return
        try:
            self._record_counts()
        finally:
            manager, self._manager = self._manager, None
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None
            manager.shutdown(wait=False)

    # --- the quorum, the heal ---------------------------------------------------------------------------
    def join(self) -> None:
        """Before the first step of a fit: the first quorum; a replica behind the others heals here, where a
        checkpoint would be loaded, and the loop starts from what it received."""
        self._joining = True
        try:
            self.begin_step()
        finally:
            self._joining = False

    def begin_step(self) -> tuple[int, int]:
        """The quorum of the coming step (formed once per step): (this group's rank among the participants,
        how many groups participate). A replica that heals from a peer mid-training raises `Rejoined`."""
        manager = self._manager
        if not self._quorum_open:
            self._healed = False
            started = time.monotonic()
            manager.start_quorum()  # synchronous: a heal (`_receive`) has run when it returns
            self._quorum_open = True
            if self._healed:
                self.counts["heals"] += 1
                took = time.monotonic() - started
                self._say(
                    f"healed from a live replica at step {self._loop.global_step} in {took:.2f} s "
                    f"(epoch {self.cursor.epoch}, sample {self.cursor.position} of its order)"
                )
                self._record_counts()
                # What this process committed before is superseded by the state it received (it may have trained
                # alone, in a quorum of its own, while the others were busy: see docs/fault-tolerance.md).
                self._write_ledger({"healed": self._loop.global_step, **self.cursor.state_dict()})
                if not self._joining:
                    raise Rejoined
        rank = manager.participating_rank()
        participants = manager.num_participants()
        if participants != self._last_participants:
            if self._last_participants:
                self._say(
                    f"replica groups in the quorum: {self._last_participants} -> {participants} "
                    f"(step {self._loop.global_step})"
                )
            self._last_participants = participants
        return (0 if rank is None else rank), participants

    def _receive(self, state: dict[str, Any]) -> None:
        """The manager's heal: the run state a live peer sent, loaded as a checkpoint would be."""
        self._load_state_dict(state)
        self._healed = True

    # --- the step's samples ---------------------------------------------------------------------------
    def assign(self, size: int, batch_size: int) -> tuple[int, int, int, int] | None:
        """The coming step's samples: (start, end, this process's first position, stride) in the epoch's
        global order of `size` samples, or None when the rest of the epoch is smaller than one global batch
        (the epoch ends: those samples are not trained this epoch, as with `drop_last`)."""
        rank, participants = self.begin_step()
        world = participants * self._group_size
        start = self.cursor.position
        end = start + world * batch_size
        if end > size:  # the epoch's last samples, fewer than one global batch: not trained this epoch
            self._assigned = None
            self._write_ledger({"epoch": self.cursor.epoch, "tail": [start, size], "participants": participants})
            return None
        self._assigned = (start, end, participants)
        return start, end, start + rank * self._group_size + self._group_rank, world

    # --- the commit point ----------------------------------------------------------------------------
    def commit(self, parameters: list[torch.Tensor]) -> bool:
        """After the step's backward, before any optimizer step: the gradients averaged across the
        participating groups, then the quorum's vote. True: the step commits (the cursor moves past its global
        batch, the ledger records it). False: nothing of it may be applied."""
        manager = self._manager
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        manager.allreduce(flat).wait()  # a failed peer: the manager holds the error, the vote says no
        self._quorum_open = False
        if not manager.should_commit():
            self.counts["redone"] += 1
            self._say(
                f"step {self._loop.global_step + 1} not committed ({_reason(manager)}): its samples are trained "
                "again by the next quorum"
            )
            return False
        offset = 0
        for p, g in zip(parameters, grads, strict=True):
            n = g.numel()
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + n].view_as(g))
            offset += n
        assigned = self._assigned
        assert assigned is not None
        start, end, participants = assigned
        self.cursor.position = end
        self.counts["commits"] += 1
        self.counts["participants"] = participants
        # Every participant records the committed global range: their union survives any one's death.
        self._write_ledger(
            {"epoch": self.cursor.epoch, "start": start, "end": end, "step": self._loop.global_step + 1,
             "participants": participants}
        )  # fmt: skip
        return True

    def _write_ledger(self, record: dict[str, Any]) -> None:
        if self._ledger is not None:
            self._ledger.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
            self._ledger.flush()

    def use_order(self, order: tuple[Any, ...]) -> None:
        """The training loader's global order (`QuorumBatches`, at setup), in `global_order`'s terms."""
        self.order_key = order

    # --- the data position a checkpoint holds (`StateDictMixin._data_state`, `_rank_data_state`) ------------
    def data_position(self, mid_epoch: bool) -> dict[str, Any]:
        """The checkpoint's data entries under fault tolerance, in the terms of a resume at any world size
        (`dream_trainer.utils.data_reshard`): the global order (a `DistributedSampler`'s over all ranks) and the
        global sample cursor. A run without fault tolerance continues from them on any number of processes."""
        return {
            "global_order": self.order_key,
            "samples_done": self.cursor.position if mid_epoch else None,
            "samples_per_step": None,  # a quorum's, which changes
            "fault_tolerance": True,
        }

    def resumed_data(self, data: dict[str, Any]) -> dict[str, Any]:
        """The data position of a checkpoint being loaded, as this replica continues it. Written under fault
        tolerance: as it is (the cursor is this object's entry). Written without it, mid-epoch: the cursor starts
        at its global sample cursor where both runs read the same global order; otherwise `CheckpointError`."""
        if data.get("fault_tolerance") or not int(data.get("batches_done", 0)):
            return data
        from dream_trainer.utils.data_reshard import as_order, samples_done

        saved, done = as_order(data.get("global_order")), samples_done(data)
        if saved != self.order_key or done is None:
            theirs = saved if saved is not None else f"its {data.get('order_source') or 'sampler'}'s own"
            raise CheckpointError(
                "this checkpoint, written mid-epoch without fault_tolerance, cannot continue its epoch under it: "
                "resume from one written at an epoch end, or of a run whose loader used GlobalOrderSampler(dataset, "
                f"seed=config.seed).\nIts training order over all ranks is {theirs}, this run's {self.order_key} (a "
                "shuffle under fault tolerance is a DistributedSampler's of config.seed)."
            )
        self.cursor.epoch, self.cursor.position = int(data["epoch"]), done
        return {**data, "loader_state": {"continue": True}, "epoch_rng": None}

    def start_epoch(self, epoch: int) -> None:
        self.cursor.epoch, self.cursor.position = epoch, 0

    # --- what it says ---------------------------------------------------------------------------------
    def _record_counts(self) -> None:
        entry = {"replica_id": self.replica_id, **self.counts, **self.cursor.state_dict()}
        self._record_in_run("fault_tolerance", entry)

    def _say(self, line: str) -> None:
        if self._group_rank == 0:
            print(f"dream_trainer: fault tolerance: {line}", file=sys.stderr, flush=True)


def _weights_only_transport() -> type:
    """torchft's HTTP heal transport, reading what a peer sends with `weights_only=True` (torchft's own unpickles
    anything, to carry arbitrary objects; the trainer's run state is plain data, as its checkpoint files are, so a
    peer can send tensors and plain values, never code)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport


def _no_flight_recorder_note(record: logging.LogRecord) -> bool:
    """torchft warns at every new quorum that it cannot reset NCCL's flight recorder; without CUDA that says
    nothing (a `logging` filter on its manager's logger)."""
    return torch.cuda.is_available() or "flight recorder" not in record.getMessage()


def _reason(manager: Any) -> str:
    error = manager.errored()
    if error is not None:
        return f"{type(error.original_exception).__name__}: {str(error.original_exception)[:160]}"
    return f"{manager.num_participants()} replica group(s) took part, fewer than min_replicas or one failed"


class QuorumBatches:
    """The training loader under fault tolerance: one batch per step, read from the user's map-style loader's
    dataset at the positions the step's quorum assigns this process (positions start+k, start+k+W, ... of
    the epoch's global order, W the processes taking part). Read in the training process: a step's samples
    are known only after its quorum. Its `state_dict` says only "continue the epoch" (the cursor is the
    `FaultTolerance`'s, saved with it)."""

    def __init__(self, loader: DataLoader[Any], ft: FaultTolerance, loop: LoopState) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size or 1)
        self.collate_fn = loader.collate_fn
        from torch.utils.data import DistributedSampler

        from dream_trainer.utils.data_resume import is_random_sampler

        sampler = loader.sampler
        # A GlobalOrderSampler (a DistributedSampler) keeps its own shuffle and seed; a plain loader's shuffle
        # becomes the run's seeded order.
        self.seed: int | None = sampler.seed if isinstance(sampler, DistributedSampler) else None
        self.shuffle = sampler.shuffle if isinstance(sampler, DistributedSampler) else is_random_sampler(sampler)
        seed = ft.cursor.seed if self.seed is None else self.seed
        ft.use_order(("distributed", seed) if self.shuffle else ("sequential",))  # as `global_order` says it
        self._ft = ft
        self._loop = loop
        self._continue = False

    def state_dict(self) -> dict[str, Any]:
        return {"continue": True}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._continue = bool(state.get("continue"))

    def __iter__(self) -> Iterator[Any]:
        ft = self._ft
        if not self._continue:
            ft.start_epoch(self._loop.epoch)
        self._continue = False
        size = len(self.dataset)  # type: ignore[arg-type]
        order = ft.cursor.order(size, self.shuffle, self.seed)
        while True:
            batch = self.next_batch(order, size)
            if batch is None:
                return
            yield batch

    def next_batch(self, order: torch.Tensor | None = None, size: int | None = None) -> Any:
        """The batch of the coming step (None: the epoch's rest is smaller than one global batch)."""
        ft = self._ft
        if size is None:
            size = len(self.dataset)  # type: ignore[arg-type]
        if order is None:
            order = ft.cursor.order(size, self.shuffle, self.seed)
        where = ft.assign(size, self.batch_size)
        if where is None:
            return None
        _, end, first, stride = where
        indices = order[first:end:stride].tolist()
        return self.collate_fn([self.dataset[i] for i in indices])


def check_fault_tolerance() -> None:
    """At construction, with the setting on: torchft is installed."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise MisconfigurationError(
            "fault_tolerance needs torchft: pip install 'dream-trainer[ft]' (torchft 0.2), or set fault_tolerance=None."
        )


def check_loader(loader: Any) -> None:
    """Fault tolerance reads a map-style `DataLoader` itself; anything else is refused, naming what to use."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise MisconfigurationError(
            "fault_tolerance needs the training loader to be a torch DataLoader over a map-style dataset (with "
            f"__len__ and __getitem__), got {type(loader).__name__}: each step's samples are dealt out by its quorum "
            "from one global order."
        )
    if loader.batch_size is None:
        raise MisconfigurationError(
            "fault_tolerance needs the training DataLoader's batch_size (a batch_sampler is not read under it)."
        )


def config_dict(config: FaultToleranceConfig | None) -> dict[str, Any] | None:
    return None if config is None else asdict(config)

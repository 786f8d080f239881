"""`FaultTolerance`: the torchft side of a fit, the object a trainer with `fault_tolerance` holds (see the package
docstring)."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.errors import CheckpointError, MisconfigurationError
from dream_trainer.fault_tolerance.data import SampleCursor
from dream_trainer.fault_tolerance.setting import FaultToleranceConfig, Rejoined

if TYPE_CHECKING:
    from dream_trainer.loop_state import LoopState


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

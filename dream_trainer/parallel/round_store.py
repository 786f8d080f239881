"""The key space of one start of a torchrun worker group in torchrun's shared store.

torchrun's agents keep one TCPStore for the whole job (the workers connect to it: MASTER_ADDR/MASTER_PORT,
`TORCHELASTIC_USE_AGENT_STORE`), so a restarted group finds the keys the last one wrote (gloo's addresses
among them) and must not read them. Each start of the group needs its own prefix, the same on every rank.
`TORCHELASTIC_RESTART_COUNT` is not one: each agent counts its own restarts, and a node that joins an
elastic job later (`--nnodes=1:2`, a membership change, which no agent counts) starts at 0 beside ranks
whose agent counts 1 or more; their process groups would wait for each other forever.

`round_prefix` agrees on one: global rank 0 draws a fresh name, serves it for a moment from a TCPStore of
its own (a free port on its host), and writes where in the shared store. The other ranks read that address,
and take the name only from a server that answers: an address a dead start wrote is refused, and a port
reused since would not hold the name read. Rank 0 closes its server once every rank has the name.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch.distributed as dist

__all__ = ["round_prefix"]

_ADDRESS_KEY = "dream_trainer/round"
_NAME_KEY = "name"
_JOINED_KEY = "joined"


def round_prefix(store: dist.Store, rank: int, world_size: int, host: str, timeout: timedelta) -> str:
    """The prefix of this start's keys, the same on every rank: `dream_trainer/round_<name>`.

    `store`: torchrun's shared store; `host`: the address other ranks reach rank 0's host by (MASTER_ADDR,
    where torchrun's rank-0 agent, on rank 0's node, serves the store). Raises `TimeoutError` after `timeout`."""
    if world_size == 1:
        return f"dream_trainer/round_{uuid.uuid4().hex}"
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        return _serve(store, world_size, host, deadline)
    return _read(store, rank, deadline)


def _serve(store: dist.Store, world_size: int, host: str, deadline: float) -> str:
    name = uuid.uuid4().hex
    server = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)
    try:
        server.set(_NAME_KEY, name)
        store.set(_ADDRESS_KEY, f"{host}:{server.port}:{name}")
        while int(server.add(_JOINED_KEY, 0)) < world_size - 1:
            if time.monotonic() > deadline:
                joined = int(server.add(_JOINED_KEY, 0))
                raise TimeoutError(
                    f"global rank 0: {joined} of the {world_size - 1} other ranks joined this start of the process "
                    "group within process_group_timeout; the others did not start, or cannot reach rank 0's host "
                    "(MASTER_ADDR)"
                )
            time.sleep(0.01)
    finally:
        del server
    return f"dream_trainer/round_{name}"


def _read(store: dist.Store, rank: int, deadline: float) -> str:
    while True:
        host, port, name = store.get(_ADDRESS_KEY).decode().rsplit(":", 2)
        try:
            server = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2))
            served = server.get(_NAME_KEY).decode()
        except (RuntimeError, TimeoutError, ValueError):  # a dead start's address, or rank 0 not serving yet
            served = None
        if served == name:
            server.add(_JOINED_KEY, 1)
            return f"dream_trainer/round_{name}"
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"global rank {rank}: global rank 0 did not open this start of the process group within "
                f"process_group_timeout (last address read: {host}:{port}); it did not start, or its host "
                "cannot be reached"
            )
        time.sleep(0.1)

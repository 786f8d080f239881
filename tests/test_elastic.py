"""A live elastic run scales 2 -> 1 -> 2 processes and its sample ledger stays exact.

Two torchrun agents ("nodes", one process each) on 127.0.0.1 share a c10d rendezvous
(`--nnodes=1:2`): the run starts on 2 processes; the test kills the second node (its torchrun and its
rank, kill -9), the first node's torchrun restarts its rank on 1 process, which continues from the last
checkpoint; then a new second node joins, the first node restarts its rank again, and the run continues
on 2 processes to the end. The script is the same throughout (tests/elastic_worker.py: the per-rank batch
is the global batch over the world size).

The ledger (each step's global batch, the last line of each step) must be the uninterrupted run's,
global batch by global batch, and the weights that run's to float rounding (another number of ranks adds
the gradients in another order: see tests/test_world_sizes.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import launcher_free_env, process_tree, torchrun

sys.path.insert(0, str(Path(__file__).parent))

import elastic_worker as worker

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS = worker.EPOCHS * worker.N_SAMPLES // worker.GLOBAL_BATCH
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def _ledger(out: Path) -> list[dict]:
    path = out / "ledger.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait(what: str, done: Callable[[], bool], timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            text = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in logs if p.exists())
            pytest.fail(f"timed out waiting for {what}\n{text}")
        time.sleep(0.2)


def _kill_node(agent: subprocess.Popen[bytes]) -> None:
    """kill -9 a node: its torchrun and the ranks it started (each in a session of its own)."""
    for pid in process_tree(agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def test_a_live_elastic_run_scales_2_1_2_and_its_ledger_is_the_uninterrupted_runs(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torchrun's shared store (its default) cannot take a node that joins a running job: the new node waits for
    # the round's address, which the first node's agent never writes again (torch 2.13). The workers then host
    # each start's store themselves (docs/distributed.md, "Elastic runs").
    env = {**launcher_free_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    (tmp_path / "slow").touch()
    agents: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def node(name: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"{name}.log"
        logs.append(log)
        cmd = [
            *torchrun(
                "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=elastic-test", "--rdzv-conf=last_call_timeout=3,join_timeout=120", "--max-restarts=5",
                "--monitor-interval=0.5",
            ),
            str(WORKER), "--out", str(tmp_path),
        ]  # fmt: skip
        with open(log, "wb") as f:
            agent = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        agents.append(agent)
        return agent

    try:
        first = node("first")
        time.sleep(1.0)  # the first node hosts the rendezvous store
        second = node("second")
        _wait("2 processes training", lambda: any(r["world"] == 2 for r in _ledger(tmp_path)), 120, logs)
        _kill_node(second)
        lost_at = len(_ledger(tmp_path))
        _wait("1 process training", lambda: any(r["world"] == 1 for r in _ledger(tmp_path)[lost_at:]), 120, logs)
        shrunk_at = len(_ledger(tmp_path))
        third = node("third")
        _wait("2 processes again", lambda: any(r["world"] == 2 for r in _ledger(tmp_path)[shrunk_at:]), 120, logs)
        (tmp_path / "slow").unlink()  # on to the end at full speed
        for agent in (first, third):
            agent.wait(timeout=240)
        assert (first.returncode, third.returncode) == (0, 0), "\n".join(p.read_text()[-4000:] for p in logs)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)

    records = _ledger(tmp_path)
    worlds = [r["world"] for r in records]
    # The run went 2 -> 1 -> 2 (each change is a restart from the last checkpoint: steps after it again). On a
    # loaded machine the second node may join after the first started alone: then 1 -> 2 -> 1 -> 2.
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes in ([2, 1, 2], [1, 2, 1, 2]), worlds
    last = {r["step"]: r["ids"] for r in records}  # a step trained again: its last line
    assert sorted(last) == list(range(STEPS))
    # The uninterrupted run (one process, the same order and global batch): its global batches.
    ids: list[list[int]] = []

    class Record(worker.Callback):
        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            ids.append(sorted(trainer.step_ids))

    reference = worker.Elastic(worker.config(tmp_path / "reference", None, Record()))
    reference.fit()
    assert [last[step] for step in range(STEPS)] == ids
    final = torch.load(tmp_path / "final.pt", weights_only=False)
    assert final["world_size"] == 2
    for name, expected in reference.model.state_dict().items():
        torch.testing.assert_close(final["weights"][name], expected, **ROUNDING)


def test_the_ranks_of_a_restarted_group_agree_on_a_fresh_prefix_in_torchruns_shared_store() -> None:
    # torchrun's shared store holds what the last start wrote: here its round address, whose server is gone.
    # Both ranks must agree on the new start's prefix, whatever their agents' restart counts.
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from dream_trainer.parallel.round_store import round_prefix

    shared = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    shared.set("dream_trainer/round", f"127.0.0.1:{dead}:a-dead-start")
    got: dict[int, str] = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        client = dist.TCPStore("127.0.0.1", shared.port, is_master=False)
        got[r] = round_prefix(client, r, 2, "127.0.0.1", timedelta(seconds=30))

    # Rank 1 first: it reads the dead start's address, is refused, and waits for rank 0's.
    threads = [threading.Thread(target=rank, args=(1, 0.0)), threading.Thread(target=rank, args=(0, 1.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got[0] == got[1] and got[0].startswith("dream_trainer/round_") and "a-dead-start" not in got[0]
    again = {}  # the next start: another prefix
    threads = [threading.Thread(target=lambda r=r: again.update({r: round_prefix(
        dist.TCPStore("127.0.0.1", shared.port, is_master=False), r, 2, "127.0.0.1", timedelta(seconds=30)
    )})) for r in (0, 1)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert again[0] == again[1] != got[0]

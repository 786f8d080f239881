"""Mid-pass resume of stateful loaders is exact on every data-parallel rank (issue: every rank used to
resume from rank 0's loader state, replaying and skipping samples without a word).

One torchrun launch of tests/data_resume_ranks_worker.py (2 processes, gloo) serves the multi-process
checks; the one-process checks run the same worker in this process. See the worker for the runs A (whole),
B (checkpoint at step 5, then lost steps) and C (resumed from B's checkpoint).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import torchrun_once

from dream_trainer.errors import CheckpointError

WORKER = Path(__file__).with_name("data_resume_ranks_worker.py")
KINDS = ("stream", "map")


def _worker() -> Any:
    spec = importlib.util.spec_from_file_location("data_resume_ranks_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, log = torchrun_once(tmp_path_factory, "data_resume_ranks", WORKER, nproc=2, timeout=240)
    text = log.read_text()
    assert text.startswith("exit code 0"), text
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data_resume_one")
    _worker().main(["--out-dir", str(out)])
    return out


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _check_exact(results: list[dict[str, Any]], n_samples: int) -> None:
    for rank, r in enumerate(results):
        a, resumed = _flat(r["a_ids"]), _flat(r["b_ids"] + r["c_ids"])
        # What the rank trained before the checkpoint plus after the resume is exactly what the
        # uninterrupted run trained, in the same order: nothing replayed, nothing skipped.
        assert resumed == a, f"rank {rank}: the resumed run saw other samples than the uninterrupted one"
        assert r["loader_class"] == "StatefulDataLoader"
        for name, w in r["a_weights"].items():
            assert torch.equal(w, r["c_weights"][name]), f"rank {rank}: {name} differs after the resume"
    # Every sample exactly once per pass (epoch) over all ranks.
    per_rank = n_samples // len(results)
    for epoch in range(2):
        seen = sorted(i for r in results for i in _flat(r["a_ids"])[epoch * per_rank : (epoch + 1) * per_rank])
        assert seen == list(range(n_samples)), f"epoch {epoch}: samples missing or read twice across ranks"


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_resume_mid_pass_exactly_from_their_own_loader_state(two_ranks: Path, kind: str) -> None:
    results = [torch.load(two_ranks / f"{kind}-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["world_size"] for r in results] == [2, 2]
    # The ranks really read different data, so rank 0's state would have been wrong for rank 1.
    first_pass = _worker().N_SAMPLES // 2 // _worker().BATCH  # batches per rank in one epoch
    assert set(_flat(results[0]["a_ids"][:first_pass])).isdisjoint(_flat(results[1]["a_ids"][:first_pass]))
    _check_exact(results, _worker().N_SAMPLES)


def test_two_ranks_under_fsdp_resume_mid_pass_exactly(two_ranks: Path) -> None:
    # The same stream, the model sharded by FSDP2: each rank's loader state is still its own.
    results = [torch.load(two_ranks / f"stream_fsdp-rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["world_size"] for r in results] == [2, 2]
    _check_exact(results, _worker().N_SAMPLES)


@pytest.mark.parametrize("kind", KINDS)
def test_one_process_resumes_mid_pass_exactly(one_process: Path, kind: str) -> None:
    _check_exact([torch.load(one_process / f"{kind}-rank0.pt", weights_only=False)], _worker().N_SAMPLES)


@pytest.mark.parametrize("kind", KINDS)
def test_a_mid_pass_checkpoint_of_two_ranks_is_refused_in_one_process(
    two_ranks: Path, kind: str, tmp_path: Path
) -> None:
    worker = _worker()
    trainer = worker.Run(worker.config(tmp_path), kind)
    with pytest.raises(CheckpointError) as info:
        trainer.fit(ckpt_path=str(two_ranks / f"{kind}-mid.ckpt"))
    first = str(info.value).splitlines()[0]
    assert "by 2 process(es)" in first and "loaded by 1" in first and "same number of processes" in first
    assert len(first) < 300


def test_a_stream_every_rank_reads_whole_is_named_by_a_warning_at_the_users_code(two_ranks: Path) -> None:
    for rank in range(2):
        warned = [(m, f) for m, f in torch.load(two_ranks / f"whole-rank{rank}.pt") if "same first batch" in m]
        assert len(warned) == 1, warned
        message, filename = warned[0]
        assert message.startswith("every one of the 2 ranks read the same first batch")
        assert Path(filename).name == WORKER.name  # the user's fit() call, not dream_trainer's code
    # Streams that split themselves (DataParallelAware) and sharded map-style data: no such warning.
    for kind in KINDS:
        for rank in range(2):
            result = torch.load(two_ranks / f"{kind}-rank{rank}.pt", weights_only=False)
            assert not [m for m, _ in result["warnings"] if "same first batch" in m or "IterableDataset" in m]

"""A stream read as the parts of the run's start (`ShardedIterable.read_as_parts`, dream_trainer/data/parts.py):
on any number of ranks, each global batch holds the samples it held on the parts' number of ranks.

Trainer runs across world sizes are in tests/test_world_sizes.py (the `shards` runs of the four-rank launch);
here: the reading itself, its saved position, and a one-process resume of a plain DataLoader mid-pass.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import world_size_worker as worker
from torch.utils.data import DataLoader

from dream_trainer.data import ShardList

FILES, PER_FILE, GLOBAL_BATCH = 24, 4, 12


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    directory = tmp_path_factory.mktemp("shards")
    files = [directory / f"{k:03d}.jsonl" for k in range(FILES)]
    for k, path in enumerate(files):
        path.write_text("".join(f"{json.dumps(k * PER_FILE + j)}\n" for j in range(PER_FILE)))
    return files


def _stream(paths: list[Path], rank: int, size: int, parts: int | None = None, **kw) -> ShardList:
    data = ShardList(paths, shuffle=True, seed=0, **kw)
    data.set_data_parallel(rank, size)
    if parts is not None:
        data.read_as_parts(parts)
    return data


def _global_batches(per_rank: list[list[int]], batch: int) -> list[list[int]]:
    steps = min(len(samples) for samples in per_rank) // batch
    return [sorted(i for s in per_rank for i in s[k * batch : (k + 1) * batch]) for k in range(steps)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_every_number_of_ranks_reads_the_global_batches_of_the_parts_from_any_step(paths, parts) -> None:
    on_parts = _global_batches([list(_stream(paths, r, parts)) for r in range(parts)], GLOBAL_BATCH // parts)
    assert sorted(i for b in on_parts for i in b) == list(range(FILES * PER_FILE))  # every sample once
    for size in (1, 2, 3, 4, 6, 12):
        batch = GLOBAL_BATCH // size
        for step in (0, 1, 5):
            per_rank = []
            for rank in range(size):
                data = _stream(paths, rank, size, parts)
                data.continue_part_at(step * batch)
                per_rank.append(list(data))
            assert _global_batches(per_rank, batch) == on_parts[step:], (size, step)


def test_an_endless_stream_read_as_parts_crosses_passes_as_each_part_did(paths) -> None:
    limit = 60
    on_two = [list(itertools.islice(_stream(paths, r, 2, infinite=True), limit)) for r in range(2)]
    expected = _global_batches(on_two, GLOBAL_BATCH // 2)  # passes 0 and 1 (48 samples a part each)
    for size in (1, 3, 4):
        batch = GLOBAL_BATCH // size
        per_rank = []
        for rank in range(size):
            data = _stream(paths, rank, size, 2, infinite=True)
            data.continue_part_at(3 * batch)
            per_rank.append(list(itertools.islice(data, limit * 2 // size - 3 * batch)))
        assert _global_batches(per_rank, batch) == expected[3:], size


def test_a_position_read_as_parts_is_saved_and_loaded_by_the_same_reader(paths) -> None:
    data = _stream(paths, 1, 3, parts=2)
    it = iter(data)
    first = [next(it) for _ in range(5)]
    state = data.state_dict()
    assert state == {"epoch": 0, "position": 5, "parts": 2, "rank": 1, "size": 3, "worker_id": 0, "num_workers": 1}
    rest = list(it)
    again = _stream(paths, 1, 3)  # the parts come with the state
    again.load_state_dict(state)
    assert list(again) == rest and again.parts == 2
    assert first + rest == list(_stream(paths, 1, 3, parts=2))


def test_parts_read_by_several_loader_workers_a_rank_are_refused_naming_num_workers(paths) -> None:
    loader = DataLoader(_stream(paths, 0, 3, parts=2), batch_size=2, num_workers=2)
    with pytest.raises(Exception, match=r"num_workers=0 or 1 \(it is 2\)"):
        next(iter(loader))


def test_a_file_stream_continues_mid_pass_on_as_many_processes_from_the_cursor(tmp_path: Path) -> None:
    # One process, a plain DataLoader with one worker over a ShardList: no loader state of its own, yet the
    # resume continues the pass where the checkpoint was (the part's samples before it are read and dropped).
    whole, resumed, caught = worker.one_process_resume(tmp_path, shards=worker.shard_files(tmp_path / "files"))
    assert [ids for _, ids in resumed.record] == [ids for _, ids in whole.record][5:]
    assert not [w for w in caught if "start of the epoch" in str(w.message)]
    for name, expected in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], expected), name

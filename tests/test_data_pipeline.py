"""The data pipeline (dream_trainer.data): sharding over ranks x workers, token files, shard lists,
the padding collator and the infinite sampler, each resumed through torchdata's StatefulDataLoader."""

from __future__ import annotations

import gc
import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dream_trainer.data import (
    InfiniteSampler,
    PadCollator,
    ShardedIterable,
    ShardList,
    TokenDataset,
    TokenWindows,
    shard_indices,
)
from dream_trainer.errors import CheckpointError
from dream_trainer.registry import DATASETS

stateful = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful.StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

SEQ = 4


def token_file(tmp_path: Path, n_windows: int, dtype: str = "uint16", name: str = "tokens.bin") -> Path:
    """Tokens 0, 1, 2, ...: window i starts with token i * SEQ, so a batch tells which windows it holds."""
    path = tmp_path / name
    np.arange(n_windows * SEQ + 1, dtype=dtype).tofile(path)
    return path


def window_ids(batch) -> list[int]:
    x, y = batch
    assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
    return (x[:, 0] // SEQ).tolist()


# --- shard_indices ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 12, 33])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_shard_indices_disjoint_and_complete(n: int, size: int, workers: int) -> None:
    parts = {(r, w): list(shard_indices(n, r, size, (w, workers))) for r in range(size) for w in range(workers)}
    everything = [i for part in parts.values() for i in part]
    assert sorted(everything) == list(range(n))  # complete and disjoint
    even = {(r, w): list(shard_indices(n, r, size, (w, workers), even=True)) for r, w in parts}
    for r in range(size):
        assert sum(len(even[r, w]) for w in range(workers)) == n // size  # every rank reads as many
    assert len({i for p in even.values() for i in p}) == n - n % size


def test_shard_indices_in_the_main_process_is_worker_zero_of_one() -> None:
    assert shard_indices(10, 1, 2) == range(1, 10, 2)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        shard_indices(10, 2, 2)


# --- token files --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_windows_are_x_and_the_next_tokens(tmp_path: Path, dtype: str) -> None:
    tokens = np.arange(70_000, 70_000 + 23, dtype=np.uint32) if dtype == "uint32" else np.arange(23, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    ds = TokenWindows(tmp_path / "t.bin", seq_len=5, dtype=dtype)
    assert len(ds) == 4  # (23 - 1) // 5: the last window needs one more token for its target
    x, y = ds[3]
    assert x.dtype == torch.int64 and x.tolist() == tokens[15:20].tolist() and y.tolist() == tokens[16:21].tolist()
    with pytest.raises(IndexError):
        ds[4]


def test_token_windows_reject_a_wrong_dtype_or_size(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        TokenWindows(tmp_path / "odd.bin", 4)
    with pytest.raises(ValueError, match="use one of uint16, uint32"):
        TokenWindows(tmp_path / "odd.bin", 4, dtype="int8")


def test_token_windows_of_several_files_do_not_cross_files(tmp_path: Path) -> None:
    a, b = token_file(tmp_path, 3, name="a.bin"), token_file(tmp_path, 2, name="b.bin")
    ds = TokenWindows([a, b], SEQ)
    assert len(ds) == 5
    assert [int(ds[i][0][0]) for i in range(5)] == [0, 4, 8, 0, 4]


def test_token_dataset_sequential_and_shuffled_passes(tmp_path: Path) -> None:
    ds = TokenDataset(token_file(tmp_path, 10), SEQ)
    assert window_ids(next(iter(DataLoader(ds, batch_size=10)))) == list(range(10))
    shuffled = TokenDataset(token_file(tmp_path, 10), SEQ, shuffle=True, seed=1)
    orders = []
    for epoch in (0, 1, 0):
        shuffled.set_epoch(epoch)
        orders.append(window_ids(next(iter(DataLoader(shuffled, batch_size=10)))))
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(10))
    assert orders[0] != orders[1] and orders[0] == orders[2]  # seeded per epoch


def _read(loader, stop: int | None = None):
    """The window ids of every batch up to `stop` batches, and the loader's state at that point."""
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen += window_ids(batch)
        if i + 1 == stop:
            return seen, loader.state_dict()
    return seen, None


def test_token_dataset_resumes_exactly_over_ranks_and_workers(tmp_path: Path) -> None:
    """2 data-parallel ranks x 2 workers, stopped after 3 batches and resumed from the loader's state:
    the resumed loader yields what the uninterrupted one did, and each window is read once per pass."""
    path = token_file(tmp_path, 42)  # 42 windows: 21 per rank, 10 and 11 per worker

    def loader(rank: int, state=None):
        ds = TokenDataset(path, SEQ, shuffle=True, seed=7)
        ds.set_data_parallel(rank, 2)
        ds.set_epoch(3)
        dl = StatefulDataLoader(ds, batch_size=4, num_workers=2)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    pass_windows: list[int] = []
    for rank in (0, 1):
        it = iter(loader(rank))
        before = [i for _ in range(3) for i in window_ids(next(it))]
        state = it.state_dict()
        after = [i for batch in it for i in window_ids(batch)]
        resumed, _ = _read(loader(rank, state))
        assert resumed == after and len(before) == 12
        pass_windows += before + after
    assert sorted(pass_windows) == list(range(42))


def test_token_dataset_infinite_goes_on_with_the_next_pass(tmp_path: Path) -> None:
    ds = TokenDataset(token_file(tmp_path, 6), SEQ, shuffle=True, seed=0, infinite=True)
    it = iter(DataLoader(ds, batch_size=6))
    first, second = window_ids(next(it)), window_ids(next(it))
    assert sorted(first) == sorted(second) == list(range(6)) and first != second
    assert ds.state_dict()["epoch"] == 1


def test_a_saved_position_is_refused_by_another_rank_layout(tmp_path: Path) -> None:
    ds = TokenDataset(token_file(tmp_path, 8), SEQ)
    ds.set_data_parallel(0, 2)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    other = TokenDataset(token_file(tmp_path, 8), SEQ)
    other.set_data_parallel(0, 4)
    other.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"rank 0 of 2.*rank 0 of 4.*same data-parallel size"):
        iter(other)


def test_a_pass_saved_at_its_end_restarts_with_the_next_epoch(tmp_path: Path) -> None:
    """A checkpoint written after the last batch of an epoch: the resumed loader reads the next epoch whole."""
    ds = TokenDataset(token_file(tmp_path, 6), SEQ, shuffle=True, seed=0)
    dl = StatefulDataLoader(ds, batch_size=3)
    _read(dl)
    state = dl.state_dict()
    fresh = TokenDataset(token_file(tmp_path, 6), SEQ, shuffle=True, seed=0)
    fresh.set_epoch(1)
    resumed = StatefulDataLoader(fresh, batch_size=3)
    resumed.load_state_dict(state)
    assert sorted(_read(resumed)[0]) == list(range(6))


def test_token_dataset_is_registered_and_built_from_a_config(tmp_path: Path) -> None:
    assert {"TokenDataset", "TokenWindows", "ShardList"} <= set(DATASETS.list())
    ds = DATASETS.build({"type": "TokenDataset", "paths": str(token_file(tmp_path, 5)), "seq_len": SEQ})
    assert isinstance(ds, TokenDataset) and len(ds.windows) == 5


# --- a user's own stream ------------------------------------------------------------------------------
class Squares(ShardedIterable[int]):
    """Shard s holds s*10 .. s*10+4: what a user writes (no rank or worker code)."""

    def num_shards(self) -> int:
        return 6

    def read_shard(self, index: int, start: int):
        for k in range(start, 5):
            yield index * 10 + k


def test_own_stream_split_over_ranks_and_workers_resumes_mid_shard() -> None:
    seen = []
    for rank in (0, 1):
        ds = Squares(shuffle=True, seed=2)
        ds.set_data_parallel(rank, 2)
        it = iter(StatefulDataLoader(ds, batch_size=2, num_workers=2))
        head = [int(v) for _ in range(2) for v in next(it)]  # 4 items: inside each worker's first shard
        state = it.state_dict()
        tail = [int(v) for batch in it for v in batch]
        again = Squares(shuffle=True, seed=2)
        again.set_data_parallel(rank, 2)
        resumed = StatefulDataLoader(again, batch_size=2, num_workers=2)
        resumed.load_state_dict(state)
        assert [int(v) for batch in resumed for v in batch] == tail
        seen += head + tail
    assert sorted(seen) == sorted(s * 10 + k for s in range(6) for k in range(5))


# --- shard lists --------------------------------------------------------------------------------------
def write_tar(path: Path, keys: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for key in keys:
            for ext, data in (("txt", key.encode()), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_shard_list_reads_webdataset_tars_grouped_by_key(tmp_path: Path) -> None:
    write_tar(tmp_path / "000.tar", ["a", "b"])
    samples = list(ShardList([tmp_path / "000.tar"]))
    assert samples == [{"__key__": "a", "txt": b"a", "cls": b"1"}, {"__key__": "b", "txt": b"b", "cls": b"1"}]


def test_shard_list_splits_files_over_ranks_and_workers_and_resumes(tmp_path: Path) -> None:
    paths = []
    for f in range(5):
        paths.append(tmp_path / f"{f}.jsonl")
        paths[-1].write_text("".join(json.dumps({"f": f, "i": i}) + "\n" for i in range(3)))
    everything = []
    for rank in (0, 1):
        ds = ShardList(paths, shuffle=True, seed=4)
        ds.set_data_parallel(rank, 2)
        items = [(s["f"], s["i"]) for batch in DataLoader(ds, batch_size=None, num_workers=2) for s in [batch]]
        everything += items
    assert sorted(everything) == [(f, i) for f in range(5) for i in range(3)]
    # In-process resume in the middle of a file.
    ds = ShardList(paths, shuffle=True, seed=4)
    dl = StatefulDataLoader(ds, batch_size=None)
    it = iter(dl)
    head = [next(it) for _ in range(4)]
    state = dl.state_dict()
    tail = list(it)
    resumed = StatefulDataLoader(ShardList(paths, shuffle=True, seed=4), batch_size=None)
    resumed.load_state_dict(state)
    assert list(resumed) == tail and len(head + tail) == 15


def test_shard_list_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no reader for '\.parquet' files; pass read="):
        ShardList([tmp_path / "a.parquet"])
    ds = ShardList([tmp_path / "a.jsonl"], read=lambda p: [1, 2])
    ds.set_data_parallel(1, 2)
    with pytest.raises(ValueError, match="rank 1 of 2 has no shard to read"):
        list(ds)


# --- PadCollator --------------------------------------------------------------------------------------
def test_pad_collator_pads_tensors_and_lists_the_rest() -> None:
    collate = PadCollator(pad_value=0, pad_values={"labels": -100})
    batch = collate(
        [
            {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([6, 7, 8]), "text": "abc", "meta": {"n": 3}},
            {"input_ids": torch.tensor([9]), "labels": torch.tensor([1]), "text": "d", "meta": {"n": 1}},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8], [1, -100, -100]]
    assert batch["text"] == ["abc", "d"] and batch["meta"] == {"n": [3, 1]}


def test_pad_collator_left_padding_multiples_2d_and_tuples() -> None:
    left = PadCollator(pad_value=-1, padding_side="left", pad_to_multiple_of=4)
    assert left([torch.tensor([1, 2]), torch.tensor([3])]).tolist() == [[-1, -1, 1, 2], [-1, -1, -1, 3]]
    images = PadCollator()([torch.ones(2, 3), torch.ones(1, 1)])
    assert images.shape == (2, 2, 3) and images.sum() == 7
    x, y = PadCollator()([(torch.tensor([1.0]), 0), (torch.tensor([2.0, 3.0]), 1)])
    assert x.tolist() == [[1.0, 0.0], [2.0, 3.0]] and y == [0, 1]


def test_pad_collator_says_which_field_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"sample 1 of batch has keys \['a'\], sample 0 has \['a', 'b'\]"):
        PadCollator()([{"a": 1, "b": 2}, {"a": 1}])
    with pytest.raises(ValueError, match=r"batch\['x'\] have different numbers of dimensions"):
        PadCollator()([{"x": torch.ones(2)}, {"x": torch.ones(2, 2)}])


# --- InfiniteSampler ----------------------------------------------------------------------------------
def test_infinite_sampler_passes_cover_the_data_across_ranks() -> None:
    streams = []
    for rank in range(3):
        s = InfiniteSampler(10, seed=5)
        s.set_data_parallel(rank, 3)
        it = iter(s)
        streams.append([[next(it) for _ in range(len(s.pass_indices(p)))] for p in range(2)])
    for p in range(2):
        assert sorted(i for stream in streams for i in stream[p]) == list(range(10))
    assert streams[0][0] != streams[0][1]  # a new order every pass
    unshuffled = iter(InfiniteSampler(3, shuffle=False))
    assert [next(unshuffled) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_infinite_sampler_resumes_exactly_through_stateful_dataloader() -> None:
    """Rank 1 of 2, two workers, stopped inside the second pass: the resumed loader goes on identically."""
    data = torch.arange(20).float()
    dl = StatefulDataLoader(data, batch_size=3, sampler=_sampler(), num_workers=2)
    it = iter(dl)
    head = [next(it).tolist() for _ in range(5)]  # 15 indices: into the second pass (10 per pass)
    state = dl.state_dict()
    tail = [next(it).tolist() for _ in range(4)]
    resumed = StatefulDataLoader(data, batch_size=3, sampler=_sampler(), num_workers=2)
    resumed.load_state_dict(state)
    rit = iter(resumed)
    assert [next(rit).tolist() for _ in range(4)] == tail
    expected = [float(i) for p in range(3) for i in _sampler().pass_indices(p)]
    assert [v for batch in head + tail for v in batch] == expected[:27]


def _sampler() -> InfiniteSampler:
    sampler = InfiniteSampler(20, seed=1)
    sampler.set_data_parallel(1, 2)
    return sampler


def test_infinite_sampler_refuses_another_layout() -> None:
    s = _sampler()
    state = s.state_dict()
    other = InfiniteSampler(20, seed=1)
    other.load_state_dict(state)
    with pytest.raises(CheckpointError, match="rank 1 of 2 over 20 items, but this run is rank 0 of 1"):
        iter(other)


# --- the example ----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("restore_torch_threads")
def test_gpt_tokens_example_learns_and_resumes_exactly(tmp_path: Path) -> None:
    """examples/gpt_tokens.py: 40 steps in one go equal 20 steps, then a resume from the checkpoint to 40
    (StatefulDataLoader with 2 workers over the token file: the same windows in the same order)."""
    from helpers import load_example

    example = load_example("gpt_tokens")
    common = [
        "--sentences",
        "2000",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--total-steps",
        "40",
        "--val-every",
        "20",
        "--ckpt-every",
        "20",
        "--quiet",
    ]
    straight = example.main([*common, "--max-steps", "40", "--root-dir", str(tmp_path / "a")])
    example.main([*common, "--max-steps", "20", "--root-dir", str(tmp_path / "b")])
    gc.collect()  # the first fit's loader iterator (an infinite stream, never exhausted) ends its workers
    resumed = example.main([*common, "--max-steps", "40", "--root-dir", str(tmp_path / "b"), "--resume"])
    assert straight["global_step"] == resumed["global_step"] == 40
    assert straight["val_loss"] < 0.6 * math.log(256), straight  # learned from the token file
    a, b = straight["model"].state_dict(), resumed["model"].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

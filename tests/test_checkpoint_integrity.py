"""Nothing damaged is trusted: a checkpoint is verified (bytes, sections, weights) before it is loaded.

"last" skips a damaged file with a warning naming it, the part that failed and the file used instead, and
the run then ends exactly as an uninterrupted one; an explicit path is refused naming the file and the part.
The campaign damages the newest checkpoint at random (bit flips anywhere in the file, truncations, deleted
sections, NaN weights and optimizer state) and resumes every time.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import struct
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import ckpt_dir

from dream_trainer import Callback, CheckpointError, ModelCheckpoint, TrainingInterrupted
from dream_trainer.utils.checkpoint_io import find_last, read_checkpoint


class AdamTrainer(TinyTrainer):
    """TinyTrainer with AdamW: optimizer state (`exp_avg_sq`) that a damaged file could corrupt."""

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)


def _trainer(root: Path, n_epochs: int) -> AdamTrainer:
    every4 = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1, save_last=True)
    return AdamTrainer(quiet_config(root, n_epochs=n_epochs, callbacks=[every4]))


def _weights(trainer: TinyTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """A run stopped after 2 epochs (checkpoints at steps 4 and 8, last.ckpt naming step 8), and the
    weights of an uninterrupted 3-epoch run (12 steps)."""
    root = tmp_path_factory.mktemp("integrity")
    _trainer(root / "run", n_epochs=2).fit()
    reference = _trainer(root / "reference", n_epochs=3)
    reference.fit()
    return root / "run", _weights(reference)


def _copy_run(written: Path, to: Path) -> Path:
    shutil.copytree(written, to, symlinks=True)  # copytree copies the hard link last.ckpt as its own file
    newest = ckpt_dir(to) / "epoch=1-step=8.ckpt"
    os.unlink(ckpt_dir(to) / "last.ckpt")
    os.link(newest, ckpt_dir(to) / "last.ckpt")  # as the run left it: last.ckpt is the newest file
    return newest


def _resume(root: Path) -> tuple[AdamTrainer, list[str]]:
    trainer = _trainer(root, n_epochs=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ckpt_path="last")
    return trainer, [str(w.message) for w in caught]


def _resave(path: Path, change: Any) -> None:
    state = torch.load(path, weights_only=True)
    change(state)
    tmp = path.with_name("tmp")
    torch.save(state, tmp)
    data = tmp.read_bytes()
    tmp.unlink()
    with open(path, "r+b") as f:  # in place: last.ckpt, a hard link to it, sees the damage too
        f.write(data)
        f.truncate()


def _flip(path: Path, rng: random.Random) -> str:
    """One bit flipped anywhere in the file: headers, padding, the index, the tensors."""
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    with open(path, "r+b") as f:
        f.write(data)
    return f"bit flip at byte {at} of {len(data)}"


def _flip_member(path: Path, rng: random.Random) -> str:
    """One bit flipped inside a zip member's data: the pickled index (a counter, the config) or a
    tensor's bytes, which torch.load would read without complaint."""
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.infolist() if m.filename.endswith("data.pkl") or "/data/" in m.filename]
        member = rng.choice(members)
    with open(path, "r+b") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = member.header_offset + 30 + name_len + extra_len + rng.randrange(member.file_size)
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return f"bit flip in {member.filename} at byte {at}"


def _truncate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    keep = rng.randrange(size)
    with open(path, "r+b") as f:
        f.truncate(keep)
    return f"truncated to {keep} of {size} bytes"


def _delete_section(path: Path, rng: random.Random) -> str:
    sections = [s for s in torch.load(path, weights_only=True) if s != "dream_trainer"]
    gone = rng.choice(sorted(sections))
    _resave(path, lambda state: state.pop(gone))
    return f"section {gone!r} deleted"


def _nan_weight(path: Path, rng: random.Random) -> str:
    def change(state: dict[str, Any]) -> None:
        state["models"]["model"]["weight"][0, rng.randrange(4)] = float("nan")

    _resave(path, change)
    return "a NaN weight"


def _inf_optimizer_state(path: Path, rng: random.Random) -> str:
    def change(state: dict[str, Any]) -> None:
        per_param = state["optimizers"]["optimizer"]["state"]
        per_param[rng.choice(sorted(per_param))]["exp_avg_sq"].view(-1)[0] = float("inf")

    _resave(path, change)
    return "an infinite exp_avg_sq"


DAMAGES = (
    [_flip] * 6 + [_flip_member] * 8 + [_truncate] * 4 + [_delete_section] * 4 + [_nan_weight, _inf_optimizer_state]
)


@pytest.mark.parametrize("seed", range(len(DAMAGES)))
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_exactly(tmp_path, written, seed):
    run, reference = written
    root = tmp_path / "run"
    newest = _copy_run(run, root)
    pristine = torch.load(newest, weights_only=True)
    damage = DAMAGES[seed](newest, random.Random(seed))

    trainer, messages = _resume(root)

    assert trainer.global_step == 12, damage
    for got, want in zip(_weights(trainer), reference, strict=True):
        assert torch.equal(got, want), damage
    skipped = [m for m in messages if m.startswith("skipping")]
    if skipped:  # detected: one warning names the damaged file, the part, and the file used instead
        (line,) = skipped
        assert "epoch=1-step=8.ckpt" in line and ("damaged" in line or "truncated" in line), (damage, line)
        assert "using" in line and "epoch=0-step=4.ckpt" in line, (damage, line)
        assert trainer.run_dir == root / "version_0"
    else:  # a flip the file does not depend on (zip padding, a timestamp): its contents are the pristine ones
        assert DAMAGES[seed] in (_flip, _flip_member), damage
        loaded = torch.load(newest, weights_only=True)
        assert torch.equal(loaded["models"]["model"]["weight"], pristine["models"]["model"]["weight"]), damage


def test_an_explicit_damaged_path_is_refused_naming_the_file_and_the_part(tmp_path, written):
    run, _ = written
    newest = _copy_run(run, tmp_path / "run")
    data = bytearray(newest.read_bytes())
    weight = torch.load(newest, weights_only=True)["models"]["model"]["weight"]
    at = bytes(data).find(weight.numpy().tobytes())  # the weight's own bytes in the archive
    assert at > 0
    data[at + 1] ^= 0x04
    with open(newest, "r+b") as f:
        f.write(data)
    trainer = _trainer(tmp_path / "other", n_epochs=3)
    with pytest.raises(CheckpointError) as info:
        trainer.fit(ckpt_path=newest)
    first = str(info.value).splitlines()[0]
    assert str(newest) in first and "is damaged: tensor models.model.weight" in first
    assert "CRC-32 does not match" in first and len(first) < 300


def test_a_checkpoint_without_its_counters_is_refused_and_last_falls_back(tmp_path, written):
    run, _ = written
    newest = _copy_run(run, tmp_path / "run")
    _resave(newest, lambda state: state.pop("counters"))
    with pytest.raises(CheckpointError, match=r"is damaged: section 'counters': missing; the file was written with"):
        read_checkpoint(newest)
    path, state = find_last(newest.parent)  # warns, naming both files
    assert path.name == "epoch=0-step=4.ckpt" and state["counters"]["global_step"] == 4


def test_nan_weights_in_the_newest_file_never_make_a_requeue_loop(tmp_path, written):
    """The newest file (by name, and last.ckpt) holds NaN weights: every restart resumes from the good
    file before it and trains on, and the error a NaN save raises no longer claims last.ckpt is finite."""
    run, reference = written
    root = tmp_path / "run"
    newest = _copy_run(run, root)
    _nan_weight(newest, random.Random(0))
    for _ in range(2):  # a requeued job starts the same way every time: never from the NaN file
        with pytest.warns(UserWarning, match="NaN or infinite.*using .*epoch=0-step=4.ckpt"):
            _, state = find_last(newest.parent)
        assert state["counters"]["global_step"] == 4
    trainer, _ = _resume(root)
    for got, want in zip(_weights(trainer), reference, strict=True):
        assert torch.equal(got, want)


needs_main_thread = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signal handlers need the main thread"
)


class _SigtermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@needs_main_thread
def test_last_ckpt_made_by_a_signal_moves_on_with_every_later_save(tmp_path):
    """A ModelCheckpoint without save_last: the signal's save makes last.ckpt; the next run's saves move
    it, so it is always the newest checkpoint written (a person loading it by hand gets that state)."""
    old = signal.getsignal(signal.SIGTERM)
    try:
        no_last = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
        with pytest.raises(TrainingInterrupted):
            TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[no_last, _SigtermAt(3)])).fit()
    finally:
        signal.signal(signal.SIGTERM, old)
    d = ckpt_dir(tmp_path)
    assert os.path.samefile(d / "last.ckpt", d / "signal-epoch=0-step=3.ckpt")
    resumed = TinyTrainer(
        quiet_config(tmp_path, n_epochs=3, callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
    )
    resumed.fit(ckpt_path="last")
    assert resumed.global_step == 12
    assert os.path.samefile(d / "last.ckpt", d / "epoch=2-step=12.ckpt")
    assert read_checkpoint(d / "last.ckpt")["counters"]["global_step"] == 12


def test_a_file_whose_header_lists_its_sections(tmp_path, written):
    run, _ = written
    state = read_checkpoint(ckpt_dir(run) / "epoch=1-step=8.ckpt")
    assert state["dream_trainer"]["sections"] == sorted(state)


def test_the_verification_benchmark_runs(capsys):
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location(
        "checkpoint_verify_bench", REPO / "benchmarks" / "checkpoint_verify.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick"])
    assert result["verify_ratio"] > 0 and "read_checkpoint (CRC-32" in capsys.readouterr().out

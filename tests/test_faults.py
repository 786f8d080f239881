"""The fault suite: what happens to a run, and to the files it leaves, when something goes wrong.

- a loss that turns NaN: stopped by default at the next logging point, with the steps, the value and
  the settings; no checkpoint with non-finite weights ever becomes `last.ckpt`;
- the disk fills up during a save (a small tmpfs, mounted when the tests run as root): a clear error,
  the previous checkpoint intact, no partial file chosen by "last";
- SIGKILL while a large checkpoint is being written: `fit(ckpt_path="last")` resumes from the previous
  one and ends `torch.equal` to an uninterrupted run;
- permission denied on the run directory: a clear error before any model is built.

Each of these trained to the end in silence, crashed obscurely or lost work before (see
tests/test_run_isolation.py for runs overwriting each other, tests/test_step_outputs.py for step outputs).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from conftest import TinyTrainer, quiet_config
from helpers import REPO, ckpt_dir, launcher_free_env, python
from test_logging import ReadCounter

from dream_trainer import CheckpointError, ConfigError, ModelCheckpoint, NonFiniteGradientError
from dream_trainer.errors import LoggerWriteError
from dream_trainer.utils.checkpoint_io import CheckpointWriteError, find_last, read_checkpoint
from dream_trainer.utils.run_dirs import read_record

WORKER = REPO / "tests" / "fault_worker.py"


def finite(state: dict[str, Any]) -> bool:
    return all(torch.isfinite(t).all() for t in state["models"]["model"].values())


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class NaNFrom(TinyTrainer):
    """The loss becomes NaN from global step `bad_from` on (and the weights with it)."""

    def __init__(self, config, bad_from: int = 1, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.bad_from = bad_from

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.global_step >= self.bad_from:
            out["loss"] = out["loss"] * float("nan")
        return out


# --- a NaN never trains in silence --------------------------------------------------------------------------
def test_a_nan_from_step_1_stops_the_run_by_default(tmp_path):
    trainer = NaNFrom(quiet_config(tmp_path, n_epochs=3, enable_checkpointing=True), bad_from=1)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit()
    message = str(info.value)
    # the step range, the value, the settings (per-step policies, and how to turn the check off)
    assert "global steps 1-4" in message and "loss = nan" in message
    assert "weights are no longer finite" in message
    for setting in ('non_finite_grads="raise"', '"skip"', '"retry"', 'non_finite_loss="raise"', '"ignore"'):
        assert setting in message, setting
    assert trainer.global_step == 4  # the end of the first epoch: the first logging point
    assert read_record(trainer.run_dir)["status"] == "failed"
    assert not (trainer.run_dir / "checkpoints" / "last.ckpt").exists()  # nothing NaN was saved as last


def test_between_logging_points_the_error_names_the_interval(tmp_path):
    # 8 steps per epoch, a logging point every 3; the loss is NaN from the 5th step (global_step 4 -> 5).
    trainer = NaNFrom(quiet_config(tmp_path, n_epochs=2, log_every_n_steps=3), bad_from=4, n_train=32)
    with pytest.raises(NonFiniteGradientError, match=r"the mean over global steps 4-6, read at the logging point"):
        trainer.fit()
    assert trainer.global_step == 6


def test_last_keeps_pointing_at_the_newest_finite_checkpoint(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = NaNFrom(quiet_config(tmp_path, n_epochs=2, callbacks=[cb]), bad_from=2)
    with pytest.raises(NonFiniteGradientError, match="weights are not finite at global step 3") as info:
        trainer.fit()
    d = ckpt_dir(tmp_path)
    assert "epoch=0-step=3-nonfinite.ckpt" in str(info.value)
    assert listing(d) == ["epoch=0-step=2.ckpt", "epoch=0-step=3-nonfinite.ckpt", "last.ckpt"]
    assert os.path.samefile(d / "last.ckpt", d / "epoch=0-step=2.ckpt")
    assert finite(read_checkpoint(d / "last.ckpt"))
    kept = d / "epoch=0-step=3-nonfinite.ckpt"  # kept beside it, for debugging: torch.load reads it
    assert not finite(torch.load(kept, weights_only=True))
    with pytest.raises(CheckpointError, match=r"is damaged: tensor models\.model.*NaN or infinite.*torch\.load"):
        read_checkpoint(kept)  # the trainer never loads it
    path, state = find_last(d)
    assert path.name == "last.ckpt" and state["counters"]["global_step"] == 2

    (d / "last.ckpt").unlink()  # even by step number, "last" never picks the non-finite file
    path, _ = find_last(d)
    assert path.name == "epoch=0-step=2.ckpt"

    fixed = TinyTrainer(quiet_config(tmp_path, n_epochs=2, enable_checkpointing=True))
    fixed.fit(ckpt_path="last")  # the bug fixed: continue from the newest finite state
    assert fixed.run_dir == trainer.run_dir and fixed.global_step == 8 and len(fixed.train_losses) == 6


def test_warn_reports_once_and_trains_on_with_last_still_finite(tmp_path):
    cb = ModelCheckpoint(every_n_train_steps=2, save_top_k=1, save_last=True)
    trainer = NaNFrom(quiet_config(tmp_path, n_epochs=3, callbacks=[cb], non_finite_loss="warn"), bad_from=3)
    with pytest.warns(UserWarning) as record:
        trainer.fit()
    assert trainer.global_step == 12
    texts = [str(w.message) for w in record]
    assert sum("non-finite training loss" in t for t in texts) == 1
    assert sum("weights are not finite" in t for t in texts) == 1  # the first non-finite save only
    d = ckpt_dir(tmp_path)
    assert listing(d) == ["epoch=0-step=2.ckpt", "epoch=0-step=4-nonfinite.ckpt", "last.ckpt"]
    assert finite(read_checkpoint(d / "last.ckpt"))


def test_ignore_turns_the_loss_check_off(tmp_path):
    trainer = NaNFrom(quiet_config(tmp_path, n_epochs=2, non_finite_loss="ignore"), bad_from=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit()
    assert trainer.global_step == 8
    assert torch.isnan(trainer.model.weight).all()


def test_a_nan_loss_with_finite_weights_is_reported_not_fatal(tmp_path):
    class NaNMetric(TinyTrainer):  # a NaN in a logged loss that is not backpropagated
        def training_step(self, batch, batch_idx):
            return {**super().training_step(batch, batch_idx), "aux_loss": torch.tensor(float("nan"))}

    trainer = NaNMetric(quiet_config(tmp_path, n_epochs=2))
    with pytest.warns(UserWarning, match=r"aux_loss = nan .* weights are still finite") as record:
        trainer.fit()
    assert trainer.global_step == 8
    assert sum("aux_loss" in str(w.message) for w in record) == 1


def test_skipped_steps_explain_a_nan_loss(tmp_path):
    trainer = NaNFrom(quiet_config(tmp_path, n_epochs=1, non_finite_grads="skip"), bad_from=2)
    trainer.fit()  # the skip policy dropped those steps: nothing to stop
    assert trainer.non_finite_counts["skipped"] == 2
    assert torch.isfinite(trainer.model.weight).all()


@pytest.mark.usefixtures("accelerator_reads")
def test_the_default_check_reads_nothing_more(monkeypatch, tmp_path):
    def reads(**config: Any) -> int:
        trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, **config), n_train=64, n_val=0)
        trainer._setup_fit()
        with monkeypatch.context() as m:
            counter = ReadCounter(m)
            trainer.fit()
        return counter.count

    assert reads() == reads(non_finite_loss="ignore")  # 16 logging points, not one read more


@pytest.fixture
def accelerator_reads(monkeypatch):
    from dream_trainer.utils import aggregation

    monkeypatch.setattr(aggregation, "EAGER_CPU_READS", False)


# --- disk full during a save --------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: one ~5 MB checkpoint fits, a second one beside it does not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class Heavy(TinyTrainer):
    """A ~5 MB checkpoint: a persistent buffer next to the linear model."""

    def configure_models(self) -> None:
        self.model.register_buffer("ballast", torch.ones(5 * (1 << 18)))


@pytest.mark.parametrize("async_checkpointing", [False, True], ids=["sync", "async"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(small_disk, async_checkpointing):
    cb = ModelCheckpoint(every_n_train_steps=1, save_top_k=1, save_last=True)
    config = quiet_config(small_disk, n_epochs=1, callbacks=[cb], async_checkpointing=async_checkpointing)
    trainer = Heavy(config)
    with pytest.raises(CheckpointError) as info:
        trainer.fit()
    error = info.value
    if async_checkpointing:  # raised at the next save or the end of fit: the background write's error
        error = error.__cause__
    assert isinstance(error, CheckpointWriteError) and isinstance(error, OSError)
    assert error.errno == errno.ENOSPC
    message = str(error)
    assert "epoch=0-step=2.ckpt" in message and "no space left on the device" in message
    assert "MiB free there" in message and "earlier checkpoints are untouched" in message

    d = ckpt_dir(small_disk)
    assert listing(d) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # no partial file, hidden or not
    assert os.path.samefile(d / "last.ckpt", d / "epoch=0-step=1.ckpt")
    path, state = find_last(d)
    assert path.name == "last.ckpt" and state["counters"]["global_step"] == 1
    assert read_record(trainer.run_dir)["status"] == "failed"

    # Room again: "last" continues from the intact checkpoint.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = Heavy(quiet_config(small_disk, n_epochs=1, callbacks=[ModelCheckpoint(every_n_train_steps=1)]))
    resumed.fit(ckpt_path="last")
    assert resumed.run_dir == trainer.run_dir and resumed.global_step == 4 and len(resumed.train_losses) == 3


# --- SIGKILL while a large checkpoint is written ----------------------------------------------------------
def _worker(*args: str, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [python(), str(WORKER), *args], text=True, env=launcher_free_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen,
    )  # fmt: skip


def _kill_while_writing(proc: subprocess.Popen[str], directory: Path, timeout: float = 120.0) -> str:
    """SIGKILL `proc` while it writes a checkpoint after its first complete one; returns the partial
    file's name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            names = []
        complete = [n for n in names if n.startswith("epoch=") and n.endswith(".ckpt")]
        for name in names:
            if (
                complete
                and name.startswith(".epoch=")
                and ".ckpt.tmp-" in name
                and name[1:].split(".tmp-")[0] not in complete
            ):
                with contextlib.suppress(FileNotFoundError):
                    if (directory / name).stat().st_size > (1 << 20):  # well into the write
                        os.kill(zygote.forked_child(proc.pid) or proc.pid, signal.SIGKILL)  # the writer itself
                        proc.wait()
                        return name
        time.sleep(0.0005)
    out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    raise AssertionError(f"never saw a checkpoint being written (returncode {proc.returncode})\n{out}\n{err}")


@pytest.mark.slow  # three fresh interpreters and ~100 MB checkpoints
def test_sigkill_during_a_large_save_then_last_resumes_bit_exactly(tmp_path):
    root, d = tmp_path / "run", tmp_path / "run" / "version_0" / "checkpoints"
    reference = _worker("--root-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"), "--no-checkpoints")
    killed = _worker("--root-dir", str(root), "--out", str(tmp_path / "never.pt"))
    partial = _kill_while_writing(killed, d)
    assert killed.returncode == -signal.SIGKILL
    assert (d / partial).exists(), "the kill left no partial file: it landed outside the write"
    last_step = read_checkpoint(d / "last.ckpt")["counters"]["global_step"]
    assert last_step in (4, 8, 12, 16, 20)  # the newest complete save before the kill
    found, _ = find_last(d)
    assert found.name == "last.ckpt"  # the partial file is never a candidate

    resumed = _worker("--root-dir", str(root), "--out", str(tmp_path / "resumed.pt"), "--resume")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out + err
    assert f"from last.ckpt (global step {last_step}); removed 1 partial file(s)" in err, err
    assert not any(n.startswith(".") and ".tmp-" in n for n in os.listdir(d))  # cleaned up
    ref_out, ref_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_out + ref_err

    got, ref = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "ref.pt")
    assert got["global_step"] == ref["global_step"] == 24
    assert all(torch.equal(got["net"][k], v) for k, v in ref["net"].items())
    assert sorted(got["optimizer"]) == sorted(ref["optimizer"])
    assert all(torch.equal(got["optimizer"][k], v) for k, v in ref["optimizer"].items())
    assert torch.equal(got["rng"], ref["rng"])


# --- permission denied ------------------------------------------------------------------------------------------
class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


@contextlib.contextmanager
def permissions_enforced() -> Iterator[None]:
    """As root, drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this thread's effective set (kept
    permitted, and restored after), so file permissions apply to it; as anyone else, nothing to do."""
    if os.geteuid() != 0:
        yield
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capget(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capget")
    except (OSError, AttributeError) as exc:
        pytest.skip(f"cannot drop root's permission override here: {exc}")
    saved = data[0].effective
    data[0].effective &= ~((1 << 1) | (1 << 2))
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip("cannot drop root's permission override here (capset failed)")
    try:
        yield
    finally:
        data[0].effective = saved
        libc.capset(ctypes.byref(header), data)


@pytest.mark.parametrize("where", ["root_dir", "below it"])
def test_permission_denied_is_a_clear_error_before_anything_is_built(tmp_path, where):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    root = locked if where == "root_dir" else locked / "runs"
    built: list[str] = []

    class Recording(TinyTrainer):
        def configure_models(self):
            built.append("configure_models")

    try:
        with permissions_enforced(), pytest.raises(ConfigError) as info:
            Recording(quiet_config(root, enable_checkpointing=True)).fit()
    finally:
        locked.chmod(0o755)
    message = str(info.value)
    assert f"root_dir = {str(root)!r}" in message and "Permission denied" in message, message
    assert "Make it writable, or choose another root_dir" in message
    assert built == []  # before any model was built
    assert listing(locked) == []


# --- a full disk while a logger writes ------------------------------------------------------------------
class FillsTheDisk(TinyTrainer):
    """At global step 5 the run's disk fills up (a ballast file grown until ENOSPC)."""

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        if self.global_step == 5:
            with open(Path(self.config.root_dir) / "ballast", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 16))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("logger_class", ["CSVLogger", "TensorBoardLogger"])
def test_disk_full_during_a_logger_write_says_which_logger_and_file_and_records_failed(small_disk, logger_class, capfd):
    from dream_trainer import loggers

    logger = getattr(loggers, logger_class)()
    if logger_class == "TensorBoardLogger":
        logger.flush_secs = 0  # every logging point writes through: the write that fails is the step's
    config = quiet_config(small_disk, n_epochs=1, loggers=[logger], log_every_n_steps=1)
    trainer = FillsTheDisk(config, n_train=2000)  # 500 steps: the log files outgrow the pages they have
    with pytest.raises(OSError) as info:
        trainer.fit()
    error = info.value
    assert isinstance(error, LoggerWriteError) and error.errno == errno.ENOSPC
    first = str(error).splitlines()[0]
    assert first.startswith(f"{logger_class} cannot write '{trainer.run_dir}")
    assert len(first) - len(first.split("'")[1]) < 200  # short but for the file's path
    assert "no space left on the device (" in first and "MiB free there" in first
    assert "fit(ckpt_path='last')" in first
    record = read_record(trainer.run_dir)  # written over the old record in place: no room for a new file
    assert record["status"] == "failed" and record["end_reason"].startswith("LoggerWriteError")
    assert [p.name for p in trainer.run_dir.iterdir() if ".tmp" in p.name] == []  # no temporary file left
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err  # nothing raised again at teardown or exit

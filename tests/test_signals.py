"""SIGTERM/SIGINT: finish the batch, save `signal-epoch=E-step=S.ckpt`, exit with 128 + signal, resume exactly.

The exit-code tests run the trainer in a real subprocess (the script below, written into tmp_path), so
the process really receives the signal and really ends with the uncaught `TrainingInterrupted`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from conftest import TinyTrainer, quiet_config
from helpers import ckpt_dir, python

from dream_trainer import Callback, ModelCheckpoint, TrainingInterrupted
from dream_trainer.utils.checkpoint_io import read_checkpoint

SCRIPT = r"""
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig


class Tiny(DreamTrainer):
    def __init__(self, config):
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def configure_dataloaders(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True)
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True), None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}


class Probe(Callback):
    def __init__(self, kill_step, signame):
        self.kill_step, self.signame = kill_step, signame

    def on_train_start(self, trainer):
        print(f"START step={trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.kill_step:
            print(f"KILL step={trainer.global_step}", flush=True)
            os.kill(os.getpid(), getattr(signal, self.signame))

    def on_exception(self, trainer, exception):
        code = getattr(exception, "code", None)
        print(f"ON_EXCEPTION {type(exception).__name__} code={code}", flush=True)

    def teardown(self, trainer, stage):
        print(f"TEARDOWN step={trainer.global_step}", flush=True)


def main(root, kill_step, signame, handle, resume, out):
    config = DreamTrainerConfig(
        root_dir=root,
        n_epochs=3,
        device="cpu",
        print_epoch_summary=False,
        num_sanity_val_steps=0,
        handle_signals=handle == "1",
        callbacks=[Probe(int(kill_step), signame)],
    )
    trainer = Tiny(config)
    trainer.fit(ckpt_path="last" if resume == "1" else None)
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, out)
    print(f"DONE step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train_script.py"
    if not path.exists():
        path.write_text(SCRIPT)
    return path


def _args(tmp_path: Path, root: str, kill_step: int, signame: str, handle: bool, resume: bool, out: str):
    flags = ["1" if handle else "0", "1" if resume else "0"]
    return [str(tmp_path / root), str(kill_step), signame, *flags, str(tmp_path / out)]


def _start(
    tmp_path: Path,
    root: str,
    kill_step: int = -1,
    signame: str = "SIGTERM",
    handle: bool = True,
    resume: bool = False,
    out: str = "final.pt",
) -> subprocess.Popen:
    args = _args(tmp_path, root, kill_step, signame, handle, resume, out)
    return subprocess.Popen(
        [python(), str(_script(tmp_path)), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err


# --- subprocess: exit codes, checkpoint, resume ------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resume_matches_an_uninterrupted_run(tmp_path):
    # 12 steps, SIGTERM after step 6. While the subprocess runs, train the uninterrupted reference
    # in this process with the same script (saves starting another interpreter).
    interrupted = _start(tmp_path, "run", kill_step=6, out="never.pt")
    spec = importlib.util.spec_from_file_location("signal_train_script", _script(tmp_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(*_args(tmp_path, "ref", -1, "SIGTERM", False, False, "ref.pt"))
    rc, out, err = _finish(interrupted)
    assert rc == 128 + signal.SIGTERM == 143, (rc, out, err)
    assert "KILL step=6" in out
    assert "ON_EXCEPTION TrainingInterrupted code=143" in out, out
    assert "TEARDOWN step=6" in out
    assert "DONE" not in out
    assert not (tmp_path / "never.pt").exists()

    d = tmp_path / "run" / "version_0" / "checkpoints"
    saved = d / "signal-epoch=1-step=6.ckpt"
    assert saved.is_file(), sorted(os.listdir(d))
    assert os.path.samefile(d / "last.ckpt", saved)
    assert read_checkpoint(saved)["counters"]["global_step"] == 6

    resumed = _start(tmp_path, "run", resume=True, out="resumed.pt")
    rc, out, err = _finish(resumed)
    assert rc == 0, (rc, out, err)
    assert "START step=6" in out
    assert "DONE step=12" in out

    a = torch.load(tmp_path / "resumed.pt", weights_only=True)
    b = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_sigint_saves_and_exits_130(tmp_path):
    rc, out, err = _finish(_start(tmp_path, "run", kill_step=2, signame="SIGINT"))
    assert rc == 128 + signal.SIGINT == 130, (rc, out, err)
    assert "ON_EXCEPTION TrainingInterrupted code=130" in out
    assert "TEARDOWN step=2" in out
    d = tmp_path / "run" / "version_0" / "checkpoints"
    assert os.path.samefile(d / "last.ckpt", d / "signal-epoch=0-step=2.ckpt")
    # the terminal says what stopped, where the checkpoint is and how to resume, once, without a traceback
    lines = [line for line in err.splitlines() if "stopped by" in line]
    assert lines == [
        f"dream_trainer: stopped by SIGINT at global step 2; checkpoint {d / 'signal-epoch=0-step=2.ckpt'}; "
        'resume with fit(ckpt_path="last") (CLI: --ckpt_path last)'
    ], err
    assert "Traceback" not in err


@pytest.mark.slow
def test_handle_signals_false_keeps_the_default_sigterm_behaviour(tmp_path):
    rc, out, err = _finish(_start(tmp_path, "run", kill_step=2, handle=False))
    assert rc == -signal.SIGTERM, (rc, out, err)  # killed by the signal itself
    assert "KILL step=2" in out
    assert "TEARDOWN" not in out
    d = tmp_path / "run" / "version_0" / "checkpoints"
    assert not d.exists() or not list(d.glob("*.ckpt"))


# --- in-process: handlers, hooks, the exception --------------------------------------------------------------

needs_main_thread = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signal handlers need the main thread"
)


def _custom_handler(signum, frame):  # pragma: no cover - never called
    raise AssertionError("the trainer's handler should be active during fit()")


class _SeeHandlers(Callback):
    def __init__(self):
        self.during = None

    def on_train_start(self, trainer):
        self.during = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))


class _Kill(Callback):
    def __init__(self, step, sig=signal.SIGTERM):
        self.step, self.sig = step, sig
        self.events: list[tuple[str, object]] = []

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.sig)

    def on_exception(self, trainer, exception):
        self.events.append(("on_exception", exception))

    def teardown(self, trainer, stage):
        self.events.append(("teardown", stage))


@pytest.fixture
def custom_handlers():
    """Install recognisable handlers for SIGTERM/SIGINT; restore the real ones afterwards."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in old:
        signal.signal(s, _custom_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@needs_main_thread
def test_handlers_are_installed_during_fit_and_restored_after(tmp_path, custom_handlers):
    seen = _SeeHandlers()
    TinyTrainer(quiet_config(tmp_path, callbacks=[seen])).fit()
    assert seen.during is not None
    assert seen.during[0] is not _custom_handler and seen.during[1] is not _custom_handler
    assert signal.getsignal(signal.SIGTERM) is _custom_handler
    assert signal.getsignal(signal.SIGINT) is _custom_handler


@needs_main_thread
def test_handlers_are_restored_after_a_failed_fit(tmp_path, custom_handlers):
    class Boom(TinyTrainer):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Boom(quiet_config(tmp_path)).fit()
    assert signal.getsignal(signal.SIGTERM) is _custom_handler
    assert signal.getsignal(signal.SIGINT) is _custom_handler


@needs_main_thread
def test_handle_signals_false_installs_nothing(tmp_path, custom_handlers):
    seen = _SeeHandlers()
    TinyTrainer(quiet_config(tmp_path, handle_signals=False, callbacks=[seen])).fit()
    assert seen.during == (_custom_handler, _custom_handler)


@needs_main_thread
def test_sigterm_in_process_raises_training_interrupted(tmp_path, custom_handlers):
    kill = _Kill(step=3)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[kill]))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    exc = info.value
    assert isinstance(exc, SystemExit)
    assert exc.code == 143 and exc.signum == signal.SIGTERM
    d = ckpt_dir(tmp_path)
    assert exc.checkpoint_path == d / "signal-epoch=0-step=3.ckpt"
    assert os.path.samefile(d / "last.ckpt", exc.checkpoint_path)
    assert "SIGTERM" in str(exc)
    assert trainer.global_step == 3
    assert [name for name, _ in kill.events] == ["on_exception", "teardown"]
    assert kill.events[0][1] is exc
    assert signal.getsignal(signal.SIGTERM) is _custom_handler


@needs_main_thread
def test_sigterm_with_async_checkpointing_writes_the_signal_checkpoint_synchronously(tmp_path, custom_handlers):
    kill = _Kill(step=2)
    mc = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    trainer = TinyTrainer(quiet_config(tmp_path, callbacks=[mc, kill], async_checkpointing=True))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    d = ckpt_dir(tmp_path)
    assert info.value.checkpoint_path == d / "signal-epoch=0-step=2.ckpt"
    assert os.path.samefile(d / "last.ckpt", d / "signal-epoch=0-step=2.ckpt")
    assert read_checkpoint(d / "signal-epoch=0-step=2.ckpt")["counters"]["global_step"] == 2
    assert read_checkpoint(d / "epoch=0-step=1.ckpt")["counters"]["global_step"] == 1


# --- what an interrupt says, a second Ctrl-C, rotation ----------------------------------------------------------


class _SecondSigint(Callback):
    """Ctrl-C at `step`, and again while the checkpoint it asked for is being written (`during_save`)
    or before the batch ends (not `during_save`)."""

    def __init__(self, step, during_save):
        self.step, self.during_save, self.sent = step, during_save, 0

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent:
            self.sent = 1
            os.kill(os.getpid(), signal.SIGINT)
            if not self.during_save:
                self.sent = 2
                os.kill(os.getpid(), signal.SIGINT)

    def on_save_checkpoint(self, trainer, checkpoint):
        if self.during_save and self.sent == 1:
            self.sent = 2
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs now, in the middle of the save


def _record(tmp_path):
    from dream_trainer.utils.run_dirs import read_record

    return read_record(tmp_path / "version_0")


@needs_main_thread
def test_an_interrupt_prints_one_line_with_the_checkpoint_and_how_to_resume(tmp_path, capsys, custom_handlers):
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[_Kill(step=3, sig=signal.SIGINT)]))
    with pytest.raises(TrainingInterrupted):
        trainer.fit()
    lines = [line for line in capsys.readouterr().err.splitlines() if "stopped by" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "SIGINT" in line and "global step 3" in line
    assert str(ckpt_dir(tmp_path) / "signal-epoch=0-step=3.ckpt") in line
    assert 'fit(ckpt_path="last")' in line and "--ckpt_path last" in line
    assert len(line) < 300
    assert _record(tmp_path)["status"] == "interrupted"


@needs_main_thread
def test_a_second_ctrl_c_during_the_save_waits_for_it(tmp_path, capfd, custom_handlers):
    second = _SecondSigint(step=2, during_save=True)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[second]))
    with pytest.raises(TrainingInterrupted) as info:  # not a KeyboardInterrupt in the middle of the save
        trainer.fit()
    assert second.sent == 2
    saved = ckpt_dir(tmp_path) / "signal-epoch=0-step=2.ckpt"
    assert info.value.checkpoint_path == saved and info.value.code == 130
    assert read_checkpoint(saved)["counters"]["global_step"] == 2  # complete, and last.ckpt names it
    assert os.path.samefile(ckpt_dir(tmp_path) / "last.ckpt", saved)
    assert not [p for p in os.listdir(ckpt_dir(tmp_path)) if p.startswith(".")]  # nothing partial
    assert _record(tmp_path)["status"] == "interrupted"
    err = capfd.readouterr().err
    assert "still writing the checkpoint" in err and "Traceback" not in err


@needs_main_thread
def test_a_second_ctrl_c_before_the_batch_ends_stops_at_once_and_says_so(tmp_path, capfd, custom_handlers):
    second = _SecondSigint(step=2, during_save=False)
    trainer = TinyTrainer(quiet_config(tmp_path, n_epochs=2, enable_checkpointing=True, callbacks=[second]))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.checkpoint_path is None and info.value.code == 130
    assert _record(tmp_path)["status"] == "interrupted"  # not "failed"
    err = capfd.readouterr().err
    assert "second SIGINT at global step 2 before a checkpoint was written" in err
    assert 'fit(ckpt_path="last")' in err


@needs_main_thread
def test_signal_checkpoints_are_rotated(tmp_path, custom_handlers):
    with pytest.raises(TrainingInterrupted):
        TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[_Kill(step=2)])).fit()
    with pytest.raises(TrainingInterrupted):
        TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[_Kill(step=5)])).fit(ckpt_path="last")
    with pytest.raises(TrainingInterrupted):
        TinyTrainer(quiet_config(tmp_path, n_epochs=3, callbacks=[_Kill(step=7)])).fit(ckpt_path="last")
    d = ckpt_dir(tmp_path)
    assert sorted(p.name for p in d.glob("signal-*.ckpt")) == ["signal-epoch=1-step=7.ckpt"]
    assert read_checkpoint(d / "last.ckpt")["counters"]["global_step"] == 7


class _SignalInSetup(TinyTrainer):
    """A SIGTERM while setup builds the optimizer (a large model's setup takes minutes)."""

    signal_in_setup = True

    def configure_optimizers(self) -> None:
        super().configure_optimizers()
        if self.signal_in_setup:
            os.kill(os.getpid(), signal.SIGTERM)


@needs_main_thread
def test_a_sigterm_during_setup_saves_before_the_first_step_and_the_run_continues_exactly(
    tmp_path, capfd, custom_handlers
):
    reference = TinyTrainer(quiet_config(tmp_path / "reference", n_epochs=2))
    reference.fit()

    trainer = _SignalInSetup(quiet_config(tmp_path / "run", n_epochs=2, run_name="setup"))
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert info.value.code == 143 and trainer.global_step == 0 and trainer.train_losses == []
    assert info.value.checkpoint_path == tmp_path / "run" / "setup" / "checkpoints" / "signal-epoch=0-step=0.ckpt"
    assert "stopped by SIGTERM at global step 0; checkpoint" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is _custom_handler

    # A resumed start signalled in its setup keeps its place: no step trained, the same state saved.
    again = _SignalInSetup(quiet_config(tmp_path / "run", n_epochs=2, run_name="setup", resume_from="last"))
    with pytest.raises(TrainingInterrupted):
        again.fit()
    assert again.global_step == 0 and again.train_losses == []

    resumed = _SignalInSetup(quiet_config(tmp_path / "run", n_epochs=2, run_name="setup", resume_from="last"))
    resumed.signal_in_setup = False
    resumed.fit()
    assert resumed.global_step == reference.global_step == 8
    ref = reference.model.state_dict()
    assert all(torch.equal(resumed.model.state_dict()[k], ref[k]) for k in ref)


@needs_main_thread
def test_a_signal_at_an_epochs_last_batch_resumes_into_the_next_epoch(tmp_path, custom_handlers):
    # The signal checkpoint is written at the boundary after the epoch's last batch, before the epoch ends:
    # the resumed run has no batch of that epoch left to run, ends it, and trains the next ones.
    reference = TinyTrainer(quiet_config(tmp_path / "reference", max_steps=12))
    reference.fit()
    first = TinyTrainer(quiet_config(tmp_path / "run", max_steps=12, run_name="r", callbacks=[_Kill(step=8)]))
    with pytest.raises(TrainingInterrupted):
        first.fit()
    assert first.global_step == 8  # 4 batches an epoch: the signal came at epoch 1's last batch
    resumed = TinyTrainer(quiet_config(tmp_path / "run", max_steps=12, run_name="r", resume_from="last"))
    resumed.fit()
    assert resumed.global_step == 12
    ref = reference.model.state_dict()
    assert all(torch.equal(resumed.model.state_dict()[k], ref[k]) for k in ref)

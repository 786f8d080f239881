"""Progress display: the rich bar in a real pseudo-terminal, plain lines when piped, which bar is chosen
and attached, the render throttle on the hot path, and the rate/ETA/duration helpers."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import TinyTrainer, quiet_config

import dream_trainer.callbacks.progress_base as progress_base
from dream_trainer.callbacks.progress_base import (
    ProgressBarBase,
    format_duration,
    format_metrics,
)
from dream_trainer.callbacks.rich_progress import RichProgressBar, default_progress_bar
from dream_trainer.callbacks.text_progress import TextProgress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SUBPROCESS_TIMEOUT_S = 120

TRAIN_SCRIPT = """
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks.progress_base import ProgressBarBase
from dream_trainer.callbacks.text_progress import TextProgress


class Regression(DreamTrainer):
    def configure_models(self):
        self.model = nn.Linear(4, 1)

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 4, generator=g)
        y = x.sum(1, keepdim=True)
        train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=4)
        val = DataLoader(TensorDataset(x[32:], y[32:]), batch_size=4)
        return train, val

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


callbacks = [TextProgress(every_seconds=0)] if sys.argv[1] == "text" else []
config = DreamTrainerConfig(
    n_epochs=2,
    device="cpu",
    log_every_n_steps=1,
    loggers=[],
    enable_checkpointing=False,
    callbacks=callbacks,
    root_dir="out",
)
trainer = Regression(config)
trainer.fit()
bars = [type(c).__name__ for c in trainer.callbacks if isinstance(c, ProgressBarBase)]
print("PROGRESS:" + ",".join(bars), flush=True)
"""


def _write_script(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(TRAIN_SCRIPT)
    return script


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES", "TERM"):
        env.pop(name, None)
    env.update(extra)
    return env


# --- real terminals and pipes (subprocesses) -----------------------------------------------------------------
@pytest.mark.slow  # a Python + torch subprocess, ~5 s
def test_rich_progress_bar_renders_in_a_pseudo_terminal(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    script = _write_script(tmp_path)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 40 rows, 200 columns
    env = _child_env(TERM="xterm-256color", COLUMNS="200", LINES="40")
    proc = subprocess.Popen(
        [sys.executable, str(script), "default"], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp_path
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            pytest.fail("the training script did not finish within the timeout")
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    raw = b"".join(chunks).decode("utf-8", errors="replace")
    text = ANSI.sub("", raw)
    assert returncode == 0, raw
    assert "PROGRESS:RichProgressBar" in text  # a terminal gets the rich bar by default
    assert "\x1b[" in raw  # drawn with terminal control sequences
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "8/8" in text
    assert re.search(r"\d+\.\d it/s", text), text
    assert "eta " in text
    assert "loss" in text and "val_loss" in text  # metric names are shown


@pytest.mark.slow  # a Python + torch subprocess, ~5 s
def test_piped_text_progress_prints_plain_lines(tmp_path):
    script = _write_script(tmp_path)
    result = subprocess.run(
        [sys.executable, str(script), "text"],
        capture_output=True,
        text=True,
        env=_child_env(),
        cwd=tmp_path,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[" not in out and "\x1b[" not in result.stderr
    assert "PROGRESS:TextProgress" in out.splitlines()  # the user's bar, no second one
    progress = [line for line in out.splitlines() if " it/s " in line]
    assert any(line.startswith("epoch 1/2 | ") for line in progress)
    assert any(line.startswith("epoch 2/2 | ") for line in progress)
    line_re = re.compile(r"^epoch [12]/2 \| [1-8]/8 \| \d+\.\d it/s \| eta \S+ \(run \S+\)( \| .*)?$")
    for line in progress:
        assert line_re.match(line), line
    assert len(progress) == 16  # every_seconds=0: one line per batch, 8 batches x 2 epochs
    assert any("loss" in line for line in progress)


@pytest.mark.slow  # a Python + torch subprocess, ~5 s
def test_piped_default_output_has_no_escape_codes(tmp_path):
    script = _write_script(tmp_path)
    result = subprocess.run(
        [sys.executable, str(script), "default"],
        capture_output=True,
        text=True,
        env=_child_env(TERM="xterm-256color"),
        cwd=tmp_path,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "PROGRESS:TextProgress" in result.stdout.splitlines()
    assert "\x1b[" not in result.stdout and "\x1b[" not in result.stderr
    assert "epoch 1/2 | step 8" in result.stdout  # the epoch summary lines are plain too


# --- which bar is attached ------------------------------------------------------------------------------------
class _FakeStdout(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(("tty", "expected"), [(False, TextProgress), (True, RichProgressBar)])
def test_default_progress_bar_depends_on_stdout_being_a_tty(monkeypatch, tty, expected):
    monkeypatch.setattr(sys, "stdout", _FakeStdout(tty))
    bar = default_progress_bar()
    assert type(bar) is expected


def _bars(trainer):
    return [c for c in trainer.callbacks if isinstance(c, ProgressBarBase)]


def test_progress_bar_disabled_attaches_none(tmp_path):
    trainer = TinyTrainer(quiet_config(tmp_path, enable_progress_bar=False))
    trainer.fit()
    assert _bars(trainer) == []


def test_default_progress_bar_is_attached_once(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _FakeStdout(False))
    trainer = TinyTrainer(quiet_config(tmp_path, enable_progress_bar=True))
    trainer.fit()
    (bar,) = _bars(trainer)
    assert type(bar) is TextProgress


@pytest.mark.parametrize("kind", ["text", "rich"])
def test_user_attached_progress_bar_is_not_duplicated(tmp_path, kind):
    bar = TextProgress() if kind == "text" else RichProgressBar(console=_rich_console())
    trainer = TinyTrainer(quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar]))
    trainer.fit()
    assert _bars(trainer) == [bar]


# --- rendering in-process -------------------------------------------------------------------------------------
def _rich_console():
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None)


class KeptRichProgressBar(RichProgressBar):
    """Keeps a reference to the `rich.progress.Progress` it starts, to check it is stopped later."""

    def start(self, trainer):
        super().start(trainer)
        self.started = self._progress


def test_rich_progress_bar_content(tmp_path):
    console = _rich_console()
    bar = KeptRichProgressBar(console=console)
    cfg = quiet_config(tmp_path, n_epochs=2, log_every_n_steps=1, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg).fit()
    text = ANSI.sub("", console.file.getvalue())
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "4/4" in text
    assert "it/s" in text and "eta " in text
    assert "loss" in text and "val_loss" in text
    assert not bar.started.live.is_started  # the live display is stopped at the end of training
    assert bar._progress is None


def test_rich_progress_bar_stops_on_exception(tmp_path):
    class Broken(TinyTrainer):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    console = _rich_console()
    bar = KeptRichProgressBar(console=console)
    with pytest.raises(RuntimeError, match="boom"):
        Broken(quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar])).fit()
    assert not bar.started.live.is_started  # the live display is closed, the terminal restored
    assert bar._progress is None
    out = console.file.getvalue()
    assert out.rfind("\x1b[?25h") > out.rfind("\x1b[?25l") >= 0  # the cursor is shown again


def test_text_progress_line(tmp_path, capsys):
    bar = TextProgress(every_seconds=0)
    cfg = quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg).fit()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(line.startswith("epoch 1/1 | ") and " it/s | eta " in line for line in lines)
    assert "loss" in lines[-1]


@pytest.mark.parametrize("kind", ["text", "rich"])
def test_progress_is_silent_off_rank_zero(tmp_path, capsys, kind):
    console = _rich_console()
    bar = TextProgress(every_seconds=0) if kind == "text" else RichProgressBar(console=console)
    trainer = TinyTrainer(quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar]))
    trainer.global_rank = 1
    trainer.fit()
    assert trainer.global_step == 4
    assert capsys.readouterr().out == ""
    assert console.file.getvalue() == ""


# --- the hot path: throttled rendering ------------------------------------------------------------------------
class CountingBar(ProgressBarBase):
    def __init__(self, refresh_seconds: float) -> None:
        super().__init__(refresh_seconds=refresh_seconds)
        self.renders: list[tuple[int, bool]] = []  # (batch, force)

    def render(self, trainer, force=False):
        self.renders.append((self.batch, force))


def test_render_is_not_called_more_often_than_refresh_seconds(tmp_path):
    bar = CountingBar(refresh_seconds=3600.0)
    cfg = quiet_config(tmp_path, n_epochs=2, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg, n_train=300, n_val=0, batch_size=1).fit()
    assert bar.batch == 300
    # only the forced renders at each epoch's start and end; none of the 600 batches rendered
    assert bar.renders == [(0, True), (300, True), (0, True), (300, True)]


def test_render_without_throttle_runs_every_batch(tmp_path):
    # the control for the test above: with refresh_seconds=0 every batch renders
    bar = CountingBar(refresh_seconds=0.0)
    TinyTrainer(quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar]), n_train=20, batch_size=1).fit()
    assert [b for b, force in bar.renders if not force] == list(range(1, 21))


class TickingClock:
    """A `perf_counter` that advances `tick` seconds every time it is read."""

    def __init__(self, tick: float) -> None:
        self.now = 1000.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_render_happens_once_per_refresh_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_base, "time", SimpleNamespace(perf_counter=TickingClock(0.25)))
    bar = CountingBar(refresh_seconds=1.0)
    TinyTrainer(quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar]), n_train=40, batch_size=1).fit()
    # one clock read per batch, 0.25 s apart: a render every 4 batches
    assert [b for b, force in bar.renders if not force] == list(range(4, 41, 4))


@pytest.mark.parametrize("cls", [TextProgress, RichProgressBar])
def test_per_batch_cost_is_tiny(cls):
    bar = cls(3600.0) if cls is TextProgress else cls(refresh_seconds=3600.0, console=_rich_console())
    trainer = SimpleNamespace(loop=SimpleNamespace(epoch_length=10**6), is_global_zero=True)
    bar.on_train_epoch_start(trainer)
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        bar.on_train_batch_end(trainer, None, None, i)
    per_call = (time.perf_counter() - start) / n
    assert bar.batch == n
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per batch"


# --- rate, ETA and formatting helpers -------------------------------------------------------------------------
def _stub_trainer(epoch_len, n_epochs=3, accumulation=1, max_steps=None, global_step=0):
    config = SimpleNamespace(n_epochs=n_epochs, gradient_accumulation_steps=accumulation, max_steps=max_steps)
    return SimpleNamespace(
        config=config,
        num_training_batches=epoch_len,
        loop=SimpleNamespace(epoch_length=epoch_len),
        is_global_zero=True,
        global_step=global_step,
    )


@pytest.fixture
def clock(monkeypatch):
    clock = TickingClock(0.0)
    monkeypatch.setattr(progress_base, "time", SimpleNamespace(perf_counter=clock))
    return clock


def test_rate_and_etas(clock):
    bar = ProgressBarBase()
    trainer = _stub_trainer(epoch_len=30, n_epochs=3, accumulation=2, global_step=5)
    bar.on_train_start(trainer)
    assert bar.run_total == 45  # ceil(30 / 2) steps per epoch x 3 epochs
    bar.on_train_epoch_start(trainer)
    assert bar.rate() == 0.0 and bar.epoch_eta() == float("inf") and bar.run_eta(trainer) == float("inf")

    clock.now += 2.0
    bar.batch = 10
    assert bar.rate() == pytest.approx(5.0)  # batches per second
    assert bar.epoch_eta() == pytest.approx(4.0)  # 20 batches left at 5/s
    assert bar.run_eta(trainer) == pytest.approx(16.0)  # 40 steps left at 2.5 steps/s

    trainer.global_step = 50  # past the estimate: never negative
    assert bar.run_eta(trainer) == 0.0


def test_run_total_respects_max_steps_and_unknown_lengths(clock):
    bar = ProgressBarBase()
    bar.on_train_start(_stub_trainer(epoch_len=30, n_epochs=3, max_steps=20))
    assert bar.run_total == 20
    bar.on_train_start(_stub_trainer(epoch_len=None, n_epochs=3))
    assert bar.run_total == float("inf")
    bar.on_train_start(_stub_trainer(epoch_len=None, n_epochs=None, max_steps=7))
    assert bar.run_total == 7

    trainer = _stub_trainer(epoch_len=None, n_epochs=None, max_steps=None)
    bar.on_train_start(trainer)
    bar.on_train_epoch_start(trainer)
    clock.now += 1.0
    bar.batch = 3
    assert bar.rate() == pytest.approx(3.0)
    assert bar.epoch_eta() == float("inf")  # unknown epoch length
    assert format_duration(bar.epoch_eta()) == "?"


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0, "0:00"),
        (0.4, "0:00"),
        (5, "0:05"),
        (59, "0:59"),
        (60, "1:00"),
        (61, "1:01"),
        (599, "9:59"),
        (3599, "59:59"),
        (3600, "1:00:00"),
        (3661, "1:01:01"),
        (36000, "10:00:00"),
        (90061, "25:01:01"),  # hours do not wrap into days
        (float("nan"), "?"),
        (float("inf"), "?"),
    ],
)
def test_format_duration(seconds, expected):
    assert format_duration(seconds) == expected


@pytest.mark.parametrize(
    ("seconds", "acceptable"),
    [(-1.0, ("0:00", "-0:01")), (-3700.0, ("0:00", "-1:01:40")), (float("-inf"), ("?", "0:00"))],
)
def test_format_duration_of_negative_durations(seconds, acceptable):
    assert format_duration(seconds) in acceptable


def test_format_metrics():
    metrics = {f"m{i}": float(i) + 0.123456 for i in range(8)}
    assert format_metrics(metrics) == "  ".join(f"m{i} {i + 0.123456:.4g}" for i in range(6))
    assert format_metrics(metrics, limit=2) == "m0 0.1235  m1 1.123"
    assert format_metrics({}) == ""
    assert format_metrics({"loss": 1234567.0, "tiny": 1e-7}) == "loss 1.235e+06  tiny 1e-07"


def test_progress_bar_counts_batches_per_epoch(tmp_path):
    seen: list[tuple[int, int | None]] = []

    class Peek(CountingBar):
        def on_train_epoch_end(self, trainer):
            seen.append((self.batch, self.epoch_total))
            super().on_train_epoch_end(trainer)

    bar = Peek(refresh_seconds=3600.0)
    cfg = quiet_config(tmp_path, n_epochs=2, limit_train_batches=3, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg).fit()
    assert seen == [(3, 3), (3, 3)]
    assert bar.run_total == 6

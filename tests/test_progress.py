"""Progress display: plain lines when piped, which bar is chosen and attached, the rich display's content
and its hand-over to the epoch summary, the render throttle on the hot path, the rate/ETA helpers and
how lines fit a width. The display in a real terminal is tests/test_progress_terminal.py's."""

from __future__ import annotations

import io
import os
import re
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import TinyTrainer, quiet_config
from helpers import run_python_forked

import dream_trainer.callbacks.progress_base as progress_base
from dream_trainer import Callback
from dream_trainer.callbacks.progress_base import ProgressBarBase
from dream_trainer.callbacks.progress_layout import (
    BAR_DONE,
    BAR_TODO,
    LineState,
    format_duration,
    format_rate,
    layout_line,
    layout_lines,
    metric_items,
    plain,
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


callbacks = [TextProgress(every_n_seconds=0)] if sys.argv[1] == "text" else []
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


# --- pipes (subprocesses) --------------------------------------------------------------------------------------
@pytest.mark.slow  # a Python + torch subprocess, ~5 s
def test_piped_text_progress_prints_plain_lines(tmp_path):
    script = _write_script(tmp_path)
    result = run_python_forked(script, "text", env=_child_env(), cwd=tmp_path, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[" not in out and "\x1b[" not in result.stderr
    assert "PROGRESS:TextProgress" in out.splitlines()  # the user's bar, no second one
    progress = [line for line in out.splitlines() if " it/s " in line]
    assert any(line.startswith("epoch 1/2 | ") for line in progress)
    assert any(line.startswith("epoch 2/2 | ") for line in progress)
    line_re = re.compile(r"^epoch [12]/2 \| [1-7]/8 \| \d+:\d\d<\S+ \| [0-9.]+ (it/s|s/it) \| run eta \S+( \| .*)?$")
    for line in progress:
        assert line_re.match(line), line
    # every_n_seconds=0: one line per batch but the last, whose line is the summary: 7 batches x 2 epochs
    assert len(progress) == 14
    assert any("loss" in line for line in progress)


@pytest.mark.slow  # a Python + torch subprocess, ~5 s
def test_piped_default_output_has_no_escape_codes(tmp_path):
    script = _write_script(tmp_path)
    result = run_python_forked(
        script, "default", env=_child_env(TERM="xterm-256color"), cwd=tmp_path, timeout=SUBPROCESS_TIMEOUT_S
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
def _rich_console(width=200, file=None):
    from rich.console import Console

    return Console(file=io.StringIO() if file is None else file, force_terminal=True, width=width, color_system=None)


def _screen(output: str, columns: int, rows: int = 40) -> list[str]:
    """The screen a terminal shows after `output` (pty output: newlines are carriage return + newline)."""
    pyte = pytest.importorskip("pyte")
    screen = pyte.Screen(columns, rows)
    pyte.Stream(screen).feed(output.replace("\r\n", "\n").replace("\n", "\r\n"))
    return [row.rstrip() for row in screen.display if row.strip()]


class KeptRichProgressBar(RichProgressBar):
    """Records every `rich.live.Live` it starts and every view it renders."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lives = []
        self.views = []  # (global_step, batch, plain lines at 200 columns)

    def render(self, trainer, force=False):
        live = self._live
        super().render(trainer, force)
        if self._live is not live:
            self.lives.append(self._live)
        lines = [plain(segments) for segments in self.view(trainer).segments(200)]
        self.views.append((trainer.global_step, self.batch, lines))


def test_rich_progress_bar_content(tmp_path):
    console = _rich_console()
    bar = KeptRichProgressBar(refresh_seconds=0.0, console=console)
    cfg = quiet_config(tmp_path, n_epochs=2, log_every_n_steps=1, enable_progress_bar=True, callbacks=[bar])
    cfg.num_sanity_val_steps = 1
    TinyTrainer(cfg).fit()
    lines = [line for _, _, view in bar.views for line in view]
    assert any(re.match(r"^epoch 1/2  +0/4 ─{40} 0:00<\?  ", line) for line in lines), lines
    assert any(re.match(r"^epoch 2/2  +4/4 ━{40} \d:\d\d<\d:\d\d  loss \S+  val_loss \S+  ", line) for line in lines)
    assert any(re.match(r"^validation +[12]/2 +[━─]{40} ", line) for line in lines)  # its own line, bar aligned
    assert any(re.match(r"^sanity check +[01]/1 +[━─]{40} ", line) for line in lines)
    assert all(not live.is_started for live in bar.lives)  # every display was stopped...
    assert len(bar.lives) == 3  # ...one for the sanity check, then one per epoch
    assert bar._live is None


def test_rich_progress_bar_shows_the_logged_numbers(tmp_path):
    from dream_trainer import MemoryLogger
    from dream_trainer.utils.numbers import format_metric

    logger = MemoryLogger()
    bar = KeptRichProgressBar(refresh_seconds=0.0, console=_rich_console())
    cfg = quiet_config(tmp_path, n_epochs=1, log_every_n_steps=2, loggers=[logger], enable_progress_bar=True)
    cfg.callbacks = [bar]
    TinyTrainer(cfg, n_train=32).fit()
    logged = dict(logger.series("loss"))
    shown = {step: re.search(r"  loss (\S+)", view[0])[1] for step, batch, view in bar.views if 2 <= batch < 8}
    assert set(shown) >= {2, 4, 6}
    for step, text in shown.items():  # mid-epoch, the line shows the last logged interval's mean, formatted alike
        assert text == format_metric(logged[step - step % 2]), (step, text, logged)


@pytest.mark.parametrize("summary", [True, False])
def test_epoch_end_leaves_one_line_per_epoch(tmp_path, capsys, summary):
    # The display writes to the same stdout as the trainer's summary, as in a terminal.
    bar = RichProgressBar(refresh_seconds=0.0, console=_rich_console(width=80, file=sys.stdout))
    cfg = quiet_config(tmp_path, n_epochs=3, print_epoch_summary=summary, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg).fit()
    screen = _screen(capsys.readouterr().out, 80)
    if summary:  # the display is cleared: the summaries alone remain
        assert [row[:14] for row in screen] == ["epoch 1/3 | st", "epoch 2/3 | st", "epoch 3/3 | st"], screen
    else:  # no summary: each epoch's final line stays instead
        assert len(screen) == 3, screen
        for epoch, row in enumerate(screen, 1):
            assert re.match(rf"^epoch {epoch}/3  +4/4 ━{{16}} \d:\d\d<\d:\d\d  (val_)?loss ", row), row


def test_rich_progress_bar_stops_on_exception(tmp_path):
    class Broken(TinyTrainer):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    console = _rich_console(width=80)
    bar = KeptRichProgressBar(refresh_seconds=0.0, console=console)
    with pytest.raises(RuntimeError, match="boom"):
        Broken(quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar])).fit()
    assert bar.lives and not bar.lives[-1].is_started  # the live display is closed, the terminal restored
    assert bar._live is None
    out = console.file.getvalue()
    assert out.rfind("\x1b[?25h") > out.rfind("\x1b[?25l") >= 0  # the cursor is shown again
    assert re.match(r"^epoch 1/1  +2/4 ", _screen(out, 80)[-1])  # where it stopped stays on screen


def test_text_progress_line(tmp_path, capsys):
    bar = TextProgress(every_n_seconds=0)
    cfg = quiet_config(tmp_path, n_epochs=1, log_every_n_steps=1, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg).fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if "| validation " not in line]
    # no summary (quiet_config): the epoch's last line is the bar's own
    assert [line.split(" | ")[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(re.match(r"^epoch 1/1 \| \d/4 \| \d:\d\d<\d:\d\d \| [0-9.]+ (it/s|s/it) \| ", line) for line in lines)
    assert "| loss " in lines[-1]


def test_text_progress_every_n_batches(tmp_path, capsys):
    bar = TextProgress(every_n_batches=3, every_n_seconds=None)
    cfg = quiet_config(tmp_path, n_epochs=2, print_epoch_summary=True, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg, n_train=40).fit()  # 10 batches per epoch
    lines = capsys.readouterr().out.splitlines()
    counts = [line.split(" | ")[1] for line in lines]
    assert counts == ["3/10", "6/10", "9/10", "step 10", "3/10", "6/10", "9/10", "step 20"]


def test_text_progress_default_cadence_suits_the_run_length(tmp_path, capsys, monkeypatch):
    clock = TickingClock(0.0)
    monkeypatch.setattr(progress_base, "time", SimpleNamespace(perf_counter=clock))

    class OneSecondPerBatch(Callback):
        def on_train_batch_start(self, trainer, batch, batch_idx):
            clock.now += 1.0

    cfg = quiet_config(tmp_path, n_epochs=1, print_epoch_summary=True, enable_progress_bar=True)
    cfg.callbacks = [OneSecondPerBatch(), TextProgress()]
    TinyTrainer(cfg, n_train=200, n_val=0, batch_size=1).fit()  # 200 s
    counts = [line.split(" | ")[1] for line in capsys.readouterr().out.splitlines()]
    # the first line after a second, each gap twice the last, then every 30 s: 12 lines in 200 s
    assert counts == [f"{n}/200" for n in (1, 3, 7, 15, 31, 61, 91, 121, 151, 181)] + ["step 200"]


def test_text_progress_every_n_seconds(tmp_path, capsys, monkeypatch):
    clock = TickingClock(0.0)
    monkeypatch.setattr(progress_base, "time", SimpleNamespace(perf_counter=clock))

    class OneSecondPerBatch(Callback):
        def on_train_batch_start(self, trainer, batch, batch_idx):
            clock.now += 1.0

    bar = TextProgress(every_n_seconds=2.5)
    cfg = quiet_config(tmp_path, n_epochs=1, print_epoch_summary=True, enable_progress_bar=True)
    cfg.callbacks = [OneSecondPerBatch(), bar]
    TinyTrainer(cfg, n_train=100, n_val=0, batch_size=1).fit()  # 100 batches: every 10 by count
    counts = [int(line.split(" | ")[1].split("/")[0]) for line in capsys.readouterr().out.splitlines()[:-1]]
    # 1 s per batch: gaps of 1, 2, then every_n_seconds (each line restarts both triggers)
    assert counts == [1, 3, *range(6, 100, 3)]


def test_text_progress_prints_long_validation_runs(tmp_path, capsys):
    bar = TextProgress(every_n_seconds=0)
    cfg = quiet_config(tmp_path, n_epochs=1, print_epoch_summary=True, enable_progress_bar=True, callbacks=[bar])
    TinyTrainer(cfg, n_val=12).fit()  # 3 validation batches
    lines = capsys.readouterr().out.splitlines()
    val = [line for line in lines if "| validation " in line]
    assert [line.split(" | ")[1] for line in val] == ["validation 1/3", "validation 2/3", "validation 3/3"]
    assert lines[-1].startswith("epoch 1/1 | step 4 | ")


@pytest.mark.parametrize(("every_n_batches", "every_n_seconds"), [(0, None), (None, -1.0)])
def test_text_progress_rejects_bad_settings(every_n_batches, every_n_seconds):
    with pytest.raises(ValueError):
        TextProgress(every_n_batches=every_n_batches, every_n_seconds=every_n_seconds)


@pytest.mark.parametrize("kind", ["text", "rich"])
def test_progress_is_silent_off_rank_zero(tmp_path, capsys, kind):
    console = _rich_console()
    bar = TextProgress(every_n_seconds=0) if kind == "text" else RichProgressBar(console=console)
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
    TinyTrainer(
        quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar]), n_train=20, n_val=0, batch_size=1
    ).fit()
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
    TinyTrainer(
        quiet_config(tmp_path, enable_progress_bar=True, callbacks=[bar]), n_train=40, n_val=0, batch_size=1
    ).fit()
    # one clock read per batch, 0.25 s apart: a render every 4 batches
    assert [b for b, force in bar.renders if not force] == list(range(4, 41, 4))


@pytest.mark.parametrize("cls", [TextProgress, RichProgressBar])
def test_per_batch_cost_is_tiny(cls):
    bar = cls(every_n_seconds=3600.0) if cls is TextProgress else cls(refresh_seconds=3600.0, console=_rich_console())
    trainer = _stub_trainer(epoch_len=10**6)
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
        loop=SimpleNamespace(epoch_length=epoch_len, resume_batch=0),
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


def test_metric_items_use_the_summary_format():
    from dream_trainer.utils.numbers import format_metric

    metrics = {"loss": 0.177912, "accuracy": 0.93124, "big": 1234567.0, "tiny": 1e-7, "zero": 0.0}
    assert metric_items(metrics) == [f"{k} {format_metric(v)}" for k, v in metrics.items()]
    assert metric_items(metrics) == ["loss 0.1779", "accuracy 0.9312", "big 1.235e+06", "tiny 1.000e-07", "zero 0"]
    assert metric_items({}) == []


@pytest.mark.parametrize(
    ("per_second", "expected"),
    [(198.04, "198 it/s"), (12.345, "12.3 it/s"), (3.211, "3.21 it/s"), (0.25, "4.00 s/it"), (0.0, "? it/s")],
)
def test_format_rate(per_second, expected):
    assert format_rate(per_second) == expected


CLASSIFIER_EXTRAS = ("loss 0.1779", "accuracy 0.9312", "val_loss 0.2559", "val_accuracy 0.9234", "198 it/s", "run 0:40")


def _classifier_line(width, done=37, total=100, extras=CLASSIFIER_EXTRAS):
    return plain(layout_line(LineState("epoch 2/5", done, total, 3.2, 5.4, extras), width))


def test_layout_at_80_columns_keeps_the_essentials_and_whole_metrics():
    line = _classifier_line(80)
    assert line == "epoch 2/5  37/100 " + BAR_DONE * 5 + BAR_TODO * 11 + " 0:03<0:05  loss 0.1779  accuracy 0.9312"
    assert len(line) <= 80


@pytest.mark.parametrize("width", [40, 60, 80, 100, 120, 160, 200, 300])
def test_layout_fits_any_width_and_drops_whole_items_from_the_right(width):
    line = _classifier_line(width)
    assert len(line) <= width
    assert re.match(r"^epoch 2/5  37/100 [━─]{10,} 0:03<0:05", line), line
    items = line.split(" 0:03<0:05")[1].split("  ")[1:]
    assert items == list(CLASSIFIER_EXTRAS[: len(items)])  # a prefix of the items, each whole


def test_wider_terminal_gets_a_wider_bar_and_more_items():
    def bar_and_items(width):
        line = _classifier_line(width)
        return len(re.search(r"[━─]+", line)[0]), line.count("  ") - 1

    bars, items = zip(*(bar_and_items(w) for w in (80, 120, 200)), strict=True)
    assert bars == (16, 24, 40)
    assert items == (2, 4, 6)


def test_layout_of_unknown_lengths_and_narrow_terminals():
    line = plain(layout_line(LineState("epoch 3", 1234, None, 65.0, float("inf"), ("loss 1",)), 80))
    assert line == "epoch 3 1234 1:05  loss 1"  # no bar, no ETA without a length
    assert _classifier_line(32) == "epoch 2/5  37/100 0:03<0:05"  # no room for a useful bar: dropped first
    for width in (12, 20, 28):  # narrower than the essentials: cropped, never wrapped
        assert len(_classifier_line(width)) <= width


def test_layout_lines_align_the_bars():
    states = [
        LineState("epoch 2/5", 100, 100, 4.0, 0.0, ("loss 0.2",)),
        LineState("validation", 3, 8, 1.0, 1.7, ("3.00 it/s",)),
    ]
    first, second = (plain(segments) for segments in layout_lines(states, 80))
    assert first.index(BAR_DONE) == second.index(BAR_DONE[0]) == len("validation") + 1 + len("100/100") + 1
    assert second.startswith("validation     3/8 ")


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


def test_etas_hold_still_while_validation_runs(clock):
    bar = ProgressBarBase()
    trainer = _stub_trainer(epoch_len=30, n_epochs=1)
    trainer.sanity_checking, trainer.val_loader = False, None
    bar.on_fit_start(trainer)
    bar.on_train_start(trainer)
    bar.on_train_epoch_start(trainer)
    for i in range(10):
        bar.on_train_batch_end(trainer, None, None, i)
    clock.now += 2.0
    trainer.global_step = 10
    assert (bar.epoch_eta(), bar.run_eta(trainer)) == (pytest.approx(4.0), pytest.approx(4.0))
    bar.on_validation_start(trainer)
    clock.now += 10.0  # a long validation: the training pace it measured is unchanged
    assert (bar.epoch_eta(), bar.run_eta(trainer)) == (pytest.approx(4.0), pytest.approx(4.0))
    bar.on_validation_end(trainer)
    assert bar.rate() == pytest.approx(5.0)


def test_epoch_total_follows_max_steps_and_a_resume_counts_from_its_position(tmp_path):
    seen: list[tuple[int, int | None]] = []

    class Peek(CountingBar):
        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, outputs, batch, batch_idx)
            seen.append((self.batch, self.epoch_total))

    class Stop(Callback):
        def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")
                raise KeyboardInterrupt

    def config(*callbacks):
        return quiet_config(tmp_path, max_steps=6, enable_progress_bar=True, callbacks=list(callbacks))

    with pytest.raises(KeyboardInterrupt):
        TinyTrainer(config(Stop()), n_train=40).fit()  # 10 batches per epoch, cut at 6 steps
    bar = Peek(refresh_seconds=3600.0)
    TinyTrainer(config(bar), n_train=40).fit(ckpt_path=tmp_path / "mid.ckpt")
    assert bar.renders[0] == (3, True)  # the first frame already shows where the epoch continues
    assert seen == [(4, 6), (5, 6), (6, 6)]  # the true position, of the 6 batches the run takes

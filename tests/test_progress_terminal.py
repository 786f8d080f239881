"""The progress display as a person sees it: examples/classifier.py run in a real pseudo-terminal of 80 and
120 columns, its output played into a terminal emulator (pyte) frame by frame; and the same example piped.

`python tests/test_progress_terminal.py 80` prints a mid-run frame and the final screen (docs/logging.md
shows them).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import python, run_python_forked

pexpect = pytest.importorskip("pexpect")
pyte = pytest.importorskip("pyte")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "classifier.py"
ARGS = ["--epochs", "3", "--n-train", "4096", "--n-val", "1024"]  # 64 training and 4 validation batches
EPOCHS, BATCHES, VAL_BATCHES = 3, 64, 4
ROWS = 30
TIMEOUT_S = 180
BAR = "━─"
# A live training line: label, count, a bar, elapsed<remaining, then whole items.
LIVE = re.compile(r"^epoch (?P<epoch>\d+)/3 +(?P<done>\d+)/64 [━─]{10,} \d+:\d\d<(\d+:\d\d|\?)(  \S.*)?$")
VALIDATION = re.compile(r"^(validation|sanity check) +\d+/\d+ +[━─]{10,} \d+:\d\d<(\d+:\d\d|\?)(  \S.*)?$")
ITEM = re.compile(r"[a-z_/]+ [-+0-9.e]+|[0-9.?]+ (it/s|s/it)|run \d+:\d\d(:\d\d)?")  # a whole metric, rate, run ETA
SUMMARY = re.compile(r"^epoch (\d+)/3 \| step \d+ \| ")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES"):
        env.pop(name, None)
    env.update(PYTHONIOENCODING="utf-8", LANG="C.UTF-8", LC_ALL="C.UTF-8", **extra)
    return env


def _rows(screen: object) -> list[str]:
    return [row.rstrip() for row in screen.display]  # type: ignore[attr-defined]


@dataclass
class TerminalRun:
    """What the terminal showed: every frame (the screen before each carriage return, i.e. before each
    redraw and after each printed line), the final screen, and rows that overflowed the width."""

    columns: int
    frames: list[list[str]] = field(default_factory=list)
    final: list[str] = field(default_factory=list)
    overflow: list[str] = field(default_factory=list)
    exit_status: int | None = None
    raw: str = ""


def run_in_terminal(columns: int, cwd: Path, command: list[str] | None = None) -> TerminalRun:
    """Run the example (or `command`, a script and its arguments) in a `columns`-wide pseudo-terminal
    and replay its output."""
    child = pexpect.spawn(
        python(),
        command or [str(EXAMPLE), *ARGS, "--root-dir", "runs"],
        dimensions=(ROWS, columns),
        env=_env(TERM="xterm-256color"),
        encoding="utf-8",
        codec_errors="replace",
        cwd=str(cwd),
    )
    screen = pyte.Screen(columns, ROWS)
    stream = pyte.Stream(screen)
    # The same bytes on a much wider screen: a line longer than `columns` shows past that column here
    # instead of wrapping, so overflow is seen even when the narrow screen hides it.
    wide = pyte.Screen(4 * columns, ROWS)
    wide_stream = pyte.Stream(wide)
    run = TerminalRun(columns)
    chunks: list[str] = []
    try:
        while True:
            try:
                data = child.read_nonblocking(65536, timeout=TIMEOUT_S)
            except pexpect.EOF:
                break
            chunks.append(data)
            for piece in re.split(r"(?=\r)", data):
                stream.feed(piece)
                wide_stream.feed(piece)
                run.frames.append(_rows(screen))
                run.overflow += [row for row in _rows(wide) if len(row) > columns and any(c in row for c in BAR)]
    finally:
        child.close(force=True)
    run.exit_status = child.exitstatus
    run.final = _rows(screen)
    run.raw = "".join(chunks)
    return run


def _items(row: str) -> list[str]:
    """The items after a live line's times, split where the display separates them."""
    rest = re.split(r"\d+:\d\d<(?:\d+:\d\d|\?)", row, maxsplit=1)[1]
    return [item for item in rest.split("  ") if item]


def _live_rows(run: TerminalRun) -> list[str]:
    return [row for frame in run.frames for row in frame if LIVE.match(row)]


@pytest.mark.slow  # the example in a subprocess, ~5 s
@pytest.mark.parametrize("columns", [80, 120])
def test_terminal_screen_while_running_and_at_the_end(tmp_path, columns):
    run = run_in_terminal(columns, tmp_path)
    assert run.exit_status == 0, run.raw[-3000:]

    # While running: each epoch's live line shows its epoch, count, bar and times...
    live = _live_rows(run)
    assert {int(LIVE.match(row)["epoch"]) for row in live} == {1, 2, 3}, "\n".join(live)
    assert {int(LIVE.match(row)["done"]) for row in live} >= {0, BATCHES}  # the epoch's start and end at least
    # ...and validation (and the sanity check) its own line.
    val_rows = {row for frame in run.frames for row in frame if VALIDATION.match(row)}
    assert any(row.startswith("validation ") for row in val_rows), "\n".join(sorted(val_rows))
    # Every row drawing a bar is a whole live line: nothing wrapped, nothing wider than the terminal.
    for frame in run.frames:
        for row in frame:
            if any(c in row for c in BAR):
                assert LIVE.match(row) or VALIDATION.match(row), f"a broken progress row: {row!r}"
            assert len(row) <= columns
    assert run.overflow == []
    # The key metrics, whole: at 80 columns the training metrics, at 120 the validation ones as well.
    later = [row for row in live if int(LIVE.match(row)["epoch"]) > 1]
    wanted = ["loss ", "accuracy "] + (["val_loss ", "val_accuracy "] if columns >= 120 else [])
    for name in wanted:
        assert any(f"  {name}" in row for row in later), f"{name!r} never shown:\n" + "\n".join(later[-5:])
    for row in live:
        assert all(ITEM.fullmatch(item) for item in _items(row)), row
    # The bar is wider on a wider terminal.
    widths = {len(re.search(r"[━─]+", row)[0]) for row in live}
    assert widths == {columns // 5}

    # At the end: each epoch's summary once, and no progress line left beside it.
    summaries = [int(m[1]) for row in run.final if (m := SUMMARY.match(row))]
    assert summaries == [1, 2, 3], "\n".join(run.final)
    assert not any(c in row for row in run.final for c in BAR), "\n".join(run.final)
    assert any(row.startswith("done: val_accuracy") for row in run.final)
    # Between summaries there is nothing left over (no stale bar, no blank line).
    first = next(i for i, row in enumerate(run.final) if SUMMARY.match(row))
    assert all(row.strip() for row in run.final[first : first + 3])
    # The summary breaks between metrics, never inside a name (the terminal would cut `val_accu|racy`).
    summary_text = " ".join(row.strip() for row in run.final[first:] if not row.startswith("done:"))
    assert "val_accuracy " in summary_text and "val_accu racy" not in summary_text
    assert all(len(row) <= columns for row in run.final)


@pytest.mark.slow  # the example in a subprocess, ~5 s
def test_piped_output_prints_periodic_lines_for_a_short_epoch(tmp_path):
    result = run_python_forked(
        EXAMPLE, *ARGS, "--root-dir", "runs", env=_env(TERM="xterm-256color"), cwd=tmp_path, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[" not in out and "\x1b[" not in result.stderr
    lines = out.splitlines()
    progress = [line for line in lines if re.match(r"^epoch \d/3 \| \d+/64 \| ", line)]
    line_re = re.compile(
        r"^epoch (\d)/3 \| (\d+)/64 \| \d+:\d\d<\d+:\d\d \| [0-9.]+ (?:it/s|s/it)( \| run eta \d+:\d\d)?"
        r"( \| [a-z_]+ [-+0-9.e]+)*$"
    )
    # The default cadence is on the clock (a first line after a second, then gaps that double): whatever
    # lines a run of this length gets are well formed, count up within their epoch, and never show the
    # last batch, whose line is the epoch summary that follows.
    assert all(line_re.match(line) for line in progress), "\n".join(progress)
    for epoch in (1, 2, 3):
        counts = [int(m[2]) for line in progress if (m := line_re.match(line)) and m[1] == str(epoch)]
        assert counts == sorted(set(counts)) and all(0 < c < 64 for c in counts), "\n".join(progress)
    # One summary line per epoch, in order, each after that epoch's progress lines.
    summaries = [i for i, line in enumerate(lines) if SUMMARY.match(line)]
    assert [lines[i][6] for i in summaries] == ["1", "2", "3"]
    for epoch, at in enumerate(summaries, 1):
        later = [line for line in lines[at + 1 :] if re.match(rf"^epoch {epoch}/3 \| \d+/64 \| ", line)]
        assert later == [], later


# --- a step-based run (max_steps, val_every_n_steps, resume) -----------------------------------------------------
STEP_RUN = Path(__file__).resolve().parent / "progress_step_run.py"
STEP_ARGS = ["--batches", "40", "--max-steps", "24", "--val-every", "8"]  # one epoch of 40 batches, cut at 24
STEP_LIVE = re.compile(r"^epoch 1(/1)? +(?P<done>\d+)/(?P<total>\d+) [━─]{10,} \d+:\d\d<(\d+:\d\d|\?)(  \S.*)?$")
VAL_RESULT = re.compile(r"^validation \| step (\d+) \| val_loss [-+0-9.e]+ \| \d+:\d\d$")
END_LINE = "training ended: stopped at max_steps=24 (step 24, epoch 1)"


def _piped(args: list[str], cwd: Path, returncode: int = 0) -> list[str]:
    result = run_python_forked(STEP_RUN, *args, env=_env(TERM="xterm-256color"), cwd=cwd, timeout=TIMEOUT_S)
    assert result.returncode == returncode, result.stderr[-3000:]
    assert "\x1b[" not in result.stdout
    return result.stdout.splitlines()


@pytest.mark.slow  # a script in a subprocess, ~4 s
@pytest.mark.parametrize("columns", [80, 120])
def test_step_based_run_in_a_terminal(tmp_path, columns):
    run = run_in_terminal(columns, tmp_path, [str(STEP_RUN), *STEP_ARGS])
    assert run.exit_status == 0, run.raw[-3000:]
    # The bar counts to where max_steps ends the run (24 of the epoch's 40 batches)...
    live = [m for frame in run.frames for row in frame if (m := STEP_LIVE.match(row))]
    assert live and {m["total"] for m in live} == {"24"}, "\n".join(m[0] for m in live)
    assert max(int(m["done"]) for m in live) == 24
    # ...each validation's results stay on screen, printed above the bar while training goes on...
    results = [int(m[1]) for row in run.final if (m := VAL_RESULT.match(row))]
    assert results == [8, 16, 24], "\n".join(run.final)
    assert any(
        any(row.startswith("validation | step 8 |") for row in frame) and any(STEP_LIVE.match(row) for row in frame)
        for frame in run.frames
    )
    # ...and the end says which limit ended training; nothing wider than the terminal, no bar left.
    assert any(row.startswith("epoch 1 | step 24 | ") for row in run.final)
    assert END_LINE in run.final
    assert not any(c in row for row in run.final for c in BAR), "\n".join(run.final)
    assert run.overflow == [] and all(len(row) <= columns for frame in run.frames for row in frame)


@pytest.mark.slow  # a script in a subprocess, ~3 s
def test_step_based_run_piped(tmp_path):
    lines = _piped(STEP_ARGS, tmp_path)
    assert [int(m[1]) for line in lines if (m := VAL_RESULT.match(line))] == [8, 16, 24], "\n".join(lines)
    progress = [line for line in lines if line.startswith("epoch 1 | ") and "| step 24 |" not in line]
    assert all(re.match(r"^epoch 1 \| \d+/24 \| ", line) for line in progress), "\n".join(progress)
    assert len(progress) <= 3  # a run of about a second: a line or two, not one per few batches
    assert lines[-2].startswith("epoch 1 | step 24 | ") and lines[-1] == END_LINE


@pytest.mark.slow  # two runs of a script in subprocesses, ~7 s
def test_resumed_run_counts_from_where_it_stopped(tmp_path):
    common = ["--batches", "40", "--epochs", "1", "--batch-seconds", "0.03"]
    _piped([*common, "--stop-at", "25"], tmp_path, returncode=3)  # a checkpoint at step 25, mid-epoch
    run = run_in_terminal(80, tmp_path, [str(STEP_RUN), *common, "--resume", "mid.ckpt"])
    assert run.exit_status == 0, run.raw[-3000:]
    counts = [int(m["done"]) for frame in run.frames for row in frame if (m := STEP_LIVE.match(row))]
    assert counts and min(counts) == 25 and max(counts) == 40, counts  # never 0/40 or 1/40 after the resume
    lines = _piped([*common, "--resume", "mid.ckpt"], tmp_path)
    counts = [int(m[1]) for line in lines if (m := re.match(r"^epoch 1/1 \| (\d+)/40 \| ", line))]
    assert all(c > 25 for c in counts), counts


@pytest.mark.slow  # a script in a subprocess, ~4 s
def test_piped_lines_never_repeat_an_earlier_epochs_numbers(tmp_path):
    # Epochs of 10 batches, logging every 15 steps: a logging step in epoch 2 (step 15), none in epoch 3.
    lines = _piped(["--batches", "10", "--epochs", "3", "--log-every", "15", "--text-every", "2"], tmp_path)
    progress = [m for line in lines if (m := re.match(r"^epoch (\d)/3 \| (\d+)/10 \| .*", line))]
    assert [(int(m[1]), int(m[2])) for m in progress] == [(e, b) for e in (1, 2, 3) for b in (2, 4, 6, 8)]
    with_loss = [(int(m[1]), int(m[2])) for m in progress if "| loss " in m[0]]
    assert with_loss == [(2, 6), (2, 8)], "\n".join(m[0] for m in progress)  # only after epoch 2's logging step


@pytest.mark.slow  # a script in a subprocess, ~6 s
def test_piped_default_cadence_prints_a_handful_of_lines_for_a_short_run(tmp_path):
    lines = _piped(["--batches", "10", "--epochs", "3", "--batch-seconds", "0.15"], tmp_path)  # about 5 s
    progress = [line for line in lines if re.match(r"^epoch \d/3 \| \d+/10 \| ", line)]
    # the first line after a second, then gaps of 2 s, 4 s, ...: not ten lines per epoch
    assert 1 <= len(progress) <= 4 and progress[0].startswith("epoch 1/3 | "), "\n".join(lines)
    summaries = [line.split(" | ")[:2] for line in lines if SUMMARY.match(line)]
    assert summaries == [[f"epoch {e}/3", f"step {10 * e}"] for e in (1, 2, 3)], "\n".join(lines)


if __name__ == "__main__":  # print the screens shown in docs/logging.md
    import tempfile

    width = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    with tempfile.TemporaryDirectory() as tmp:
        shown = run_in_terminal(width, Path(tmp))

    mid = [
        f
        for f in shown.frames
        if any((m := LIVE.match(r)) and m["epoch"] == "2" and 0 < int(m["done"]) < 64 for r in f)
    ]
    val = [f for f in shown.frames if any(VALIDATION.match(r) and r.startswith("validation") for r in f)]
    for title, frames in (("while training", mid), ("while validating", val), ("at the end", [shown.final])):
        print(f"--- {title}")
        print("\n".join(frames[len(frames) // 2] if frames else ["(no such frame)"]).rstrip())

"""`dream-trainer runs [ROOT]`: the runs under a root directory, one row each, from their `run.json`.

```
NAME       STATUS       STEP  CHECKPOINT                      HOW IT ENDED
version_0  success        40  epoch=4-step=40.ckpt            finished at global step 40
version_1  requeued       12  signal-epoch=1-step=12.ckpt     stopped by SIGUSR1 at global step 12; ...
```

Nothing is written: a run whose record says "running" but whose lock no live process holds is shown
"killed" (the next run in the root marks it so in its run.json). The status is the record's:
success, failed, interrupted (a signal stopped it: checkpoint and exit), requeued (a SLURM job's
requeue signal), hung, killed, or running. STEP is the last global step the run recorded; a run that
recorded none (running, or killed) shows its newest checkpoint's step followed by "+" (at least).
A run whose run.json is gone but whose checkpoints are not is listed too, its status "no run.json"
(`fit(ckpt_path="last")` continues it and rebuilds its record).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import ArgumentParser

from dream_trainer.cli.loading import CLIError
from dream_trainer.utils.run_dirs import (
    CHECKPOINTS,
    CONFIG_FILE,
    file_time,
    is_run_dir,
    lock_holder,
    read_record,
    record_lost,
)

__all__ = ["RunRow", "format_runs", "list_runs", "runs_command", "runs_parser"]

HELP = "List the runs under ROOT (default: runs): status, last step, newest checkpoint, how each ended."
DEFAULT_WIDTH = 80
_STEP_RE = re.compile(r"step=(\d+)")
_HEADERS = ("NAME", "STATUS", "STEP", "CHECKPOINT", "HOW IT ENDED")


@dataclass(frozen=True)
class RunRow:
    """One run, as `runs` shows it."""

    name: str
    status: str
    step: str
    checkpoint: str
    ended: str
    created: str


def runs_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="dream-trainer runs",
        description=HELP + " Reads each run's run.json; writes nothing.",
        exit_on_error=False,
    )
    parser.add_argument("root", nargs="?", default="runs", help="The root_dir of the runs.")
    parser.add_argument(
        "--width", type=int, default=None, help="Table width; none: the terminal's, or 80 when not a terminal."
    )
    return parser


def runs_command(argv: list[str]) -> int:
    """`dream-trainer runs [ROOT] [--width N]`: print the table on stdout; 0. A ROOT that is not a
    directory raises `CLIError`."""
    if any(a in ("-h", "--help") for a in argv):
        runs_parser().print_help()
        return 0
    try:
        ns = runs_parser().parse_args(argv)
    except Exception as exc:  # jsonargparse's ArgumentError, or its SystemExit-free parse failure
        raise CLIError(f"dream-trainer runs [ROOT] [--width N]: {' '.join(str(exc).split())}") from exc
    root = Path(ns.root)
    if not root.is_dir():
        raise CLIError(f"{str(root)!r} is not a directory; give the root_dir of your runs: dream-trainer runs PATH")
    rows = list_runs(root)
    if not rows:
        print(f"no runs under {str(root)!r} (a run is a directory holding run.json)", flush=True)
        return 0
    width = ns.width or (
        shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns if sys.stdout.isatty() else DEFAULT_WIDTH
    )
    print(format_runs(rows, max(width, 40)), flush=True)
    return 0


def list_runs(root: Path) -> list[RunRow]:
    """Every run directly under `root`, oldest first (by the time its record says it was created)."""
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    rows = []
    for entry in entries:
        path = root / entry
        if entry.startswith(".") or not path.is_dir():
            continue
        if is_run_dir(path):
            rows.append(_row(path))
        elif record_lost(path):
            rows.append(_row_without_record(path))
    return sorted(rows, key=lambda r: (r.created, r.name))


def _row(run_dir: Path) -> RunRow:
    record = read_record(run_dir)
    status = str(record.get("status") or "unknown")
    checkpoint = _newest_checkpoint(run_dir / CHECKPOINTS)
    reason = record.get("end_reason")
    if status == "running":
        holder = lock_holder(run_dir)
        if holder is None:
            status = "killed"  # settled as such by the next run in this root
            reason = f"died without recording how (pid {record.get('pid', '?')} on {record.get('host', '?')})"
        else:
            reason = f"running: {holder}"
    elif not reason:
        if status == "killed":
            reason = f"died without recording how; found dead {record.get('killed_noticed', '')}".rstrip()
        else:
            reason = f"{status} {record.get('ended', '')}".rstrip()
    step = record.get("global_step")
    if status in ("running", "killed") or not isinstance(step, int):
        found = _STEP_RE.findall(checkpoint)
        step_text = f"{found[-1]}+" if found else "-"
    else:
        step_text = str(step)
    return RunRow(
        name=run_dir.name,
        status=status,
        step=step_text,
        checkpoint=checkpoint or "-",
        ended=_relative_paths(str(reason), run_dir),
        created=str(record.get("created") or ""),
    )


def _row_without_record(run_dir: Path) -> RunRow:
    """A run whose run.json is gone: what its checkpoints say, created when its config.yaml was written."""
    checkpoint = _newest_checkpoint(run_dir / CHECKPOINTS)
    found = _STEP_RE.findall(checkpoint)
    holder = lock_holder(run_dir)
    reason = 'run.json is missing; fit(ckpt_path="last") rebuilds it when it continues this run'
    return RunRow(
        name=run_dir.name,
        status="no run.json",
        step=f"{found[-1]}+" if found else "-",
        checkpoint=checkpoint or "-",
        ended=f"running: {holder}; run.json is missing" if holder else reason,
        created=file_time(run_dir / CONFIG_FILE) or "",
    )


def _newest_checkpoint(directory: Path) -> str:
    """The name of the newest checkpoint in the run's own checkpoint directory ("" when none): the
    file `last.ckpt` stands for, rather than `last.ckpt` itself."""
    found: list[tuple[float, int, str, tuple[int, int]]] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return ""
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
            continue
        try:
            st = entry.stat()  # follows last.ckpt's symlink (sharded runs)
        except OSError:
            continue
        found.append((st.st_mtime, entry.name != "last.ckpt", entry.name, (st.st_dev, st.st_ino)))
    if not found:
        return ""
    newest = max(found)
    if newest[2] == "last.ckpt":  # name the checkpoint it is (a hard link or a symlink to it)
        twin = [f for f in found if f[3] == newest[3] and f[2] != "last.ckpt"]
        if twin:
            return twin[0][2]
    return newest[2]


def _relative_paths(text: str, run_dir: Path) -> str:
    """`text` with the run directory's own path left out of the paths it names (the row names the run)."""
    for prefix in {str(run_dir.resolve()), str(run_dir.absolute()), str(run_dir)}:
        text = text.replace(prefix + os.sep, "")
    return text


def format_runs(rows: list[RunRow], width: int = DEFAULT_WIDTH) -> str:
    """The table, `width` columns at most. Long names and checkpoint names lose their middle (to "…").
    HOW IT ENDED is the last column when at least 40 columns are left for it (wrapped in its column);
    otherwise it goes under its row, indented, wrapped at `width`."""
    cells = [(r.name, r.status, r.step, r.checkpoint) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(_HEADERS[:4])]
    widths = [min(w, cap) for w, cap in zip(widths, (32, 11, 8, 36), strict=True)]
    gap = 2
    for i in (3, 0):  # too wide for one line: the checkpoint column gives first, then the name
        over = sum(widths) + gap * 3 - width
        if over > 0:
            widths[i] = max(len(_HEADERS[i]), widths[i] - over)
    left = sum(widths) + gap * 4
    beside = width - left >= 40
    lines = [_line(_HEADERS[:4], widths, gap) + (" " * gap + _HEADERS[4] if beside else "")]
    for row, row_cells in zip(rows, cells, strict=True):
        first = _line(row_cells, widths, gap)
        if beside:
            wrapped = _wrap(row.ended, width - left)
            lines.append(first + " " * gap + wrapped[0])
            lines.extend(" " * left + more for more in wrapped[1:])
        else:
            lines.append(first.rstrip())
            lines.extend("    " + more for more in _wrap(row.ended, width - 4))
    return "\n".join(line.rstrip() for line in lines)


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def _line(cells: tuple[str, ...], widths: list[int], gap: int) -> str:
    parts = []
    for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
        text = _cut(cell, w)
        parts.append(text.rjust(w) if i == 2 else text.ljust(w))  # STEP: numbers right-aligned
    return (" " * gap).join(parts)


def _cut(text: str, width: int) -> str:
    """`text`, its middle replaced by "…" when longer than `width`: a run's "-v3" and a checkpoint's
    "step=N.ckpt" are at their ends."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]

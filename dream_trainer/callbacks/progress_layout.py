"""How progress is written: durations, rates, metrics, and lines fitted to a terminal's width (pure
functions: no terminal, no trainer).

Every line keeps its label, count, bar and times; what follows (metrics, then rate and run ETA) is added
left to right while whole items fit, so a narrow terminal drops items from the right and never cuts
one. An 80-column line, for instance:

    epoch 2/5  37/100 ━━━━━─────────── 0:03<0:05  loss 0.1779  accuracy 0.9312

`RichProgressBar` styles the segments; `TextProgress` writes its plain lines with the same helpers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dream_trainer.utils.numbers import format_metric

BAR_DONE = "━"  # heavy and light rules tell done from to-do without colour (logs, screen readers' copies)
BAR_TODO = "─"
MIN_BAR = 10  # narrower than this a bar says nothing a count does not
MAX_BAR = 50
EXTRA_SEP = "  "


def format_duration(seconds: float) -> str:
    """`h:mm:ss` (or `m:ss` under an hour); `?` when unknown."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):  # NaN or unknown
        return "?"
    s = max(0, int(seconds))  # a late estimate is "now", not negative
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rate(per_second: float) -> str:
    """`198 it/s`, `12.5 it/s`, `3.21 it/s`; below one batch a second, `4.00 s/it`."""
    if per_second <= 0:
        return "? it/s"
    if per_second < 1:
        return f"{1 / per_second:.2f} s/it"
    digits = 0 if per_second >= 100 else 1 if per_second >= 10 else 2
    return f"{per_second:.{digits}f} it/s"


def metric_items(metrics: Mapping[str, float]) -> list[str]:
    """`name value` for every metric, in order, with the epoch summary's number format."""
    return [f"{name} {format_metric(value)}" for name, value in metrics.items()]


@dataclass(frozen=True)
class LineState:
    """What one progress line says.

    Attributes:
        label: `epoch 2/5`, `validation`, `sanity check`.
        done: batches done.
        total: batches in the phase (None: unknown length, so no bar and no ETA).
        elapsed: seconds since the phase started.
        remaining: estimated seconds left (inf: unknown).
        extras: optional items in priority order (`loss 0.1779`, `198 it/s`, ...), shown while they fit.
    """

    label: str
    done: int
    total: int | None
    elapsed: float
    remaining: float
    extras: tuple[str, ...] = ()


# A segment is `(text, role)`; roles: "label", "count", "bar_done", "bar_todo", "time", "extra", "space".
Segment = tuple[str, str]


def bar_width_for(width: int) -> int:
    """The bar's target width on a `width`-column terminal: a fifth of it (16 at 80, 24 at 120)."""
    return max(MIN_BAR, min(MAX_BAR, width // 5))


def count_text(done: int, total: int | None, width: int = 0) -> str:
    """`37/100`, right-aligned to `width` columns."""
    text = f"{done}/{total}" if total is not None else str(done)
    return text.rjust(width)


def count_slot(state: LineState) -> int:
    """Columns the count can take in this phase (`100/100`), so the bar does not move as it grows."""
    return len(count_text(state.total, state.total) if state.total is not None else str(state.done))


def time_text(state: LineState) -> str:
    """`elapsed<remaining` (`0:03<0:05`), or the elapsed time alone when the length is unknown."""
    elapsed = format_duration(state.elapsed)
    return f"{elapsed}<{format_duration(state.remaining)}" if state.total is not None else elapsed


def layout_line(state: LineState, width: int, label_width: int = 0, count_width: int = 0) -> list[Segment]:
    """The segments of `state`'s line, at most `width` columns. `label_width`/`count_width` pad the label
    and count so that the bars of several lines start in the same column."""
    label = state.label.ljust(label_width)
    count = count_text(state.done, state.total, max(count_width, count_slot(state)))
    times = time_text(state)
    head: list[Segment] = [(label, "label"), (" ", "space"), (count, "count"), (" ", "space")]
    used = len(label) + 1 + len(count) + 1
    bar: list[Segment] = []
    if state.total is not None and state.total > 0:
        bar_width = min(bar_width_for(width), width - used - 1 - len(times))
        if bar_width >= MIN_BAR // 2:  # a very narrow terminal keeps the counts and drops the bar first
            filled = min(bar_width, int(bar_width * state.done / state.total))
            bar = [(BAR_DONE * filled, "bar_done"), (BAR_TODO * (bar_width - filled), "bar_todo"), (" ", "space")]
            used += bar_width + 1
    segments = head + bar + [(times, "time")]
    used += len(times)
    if used > width:  # narrower than the essentials (under ~30 columns): crop rather than wrap
        return _crop(segments, width)
    for extra in state.extras:
        if used + len(EXTRA_SEP) + len(extra) > width:
            break  # later items are lower priority: stop at the first one that does not fit
        segments += [(EXTRA_SEP, "space"), (extra, "extra")]
        used += len(EXTRA_SEP) + len(extra)
    return segments


def layout_lines(states: Sequence[LineState], width: int) -> list[list[Segment]]:
    """Several lines (training and validation) laid out with their bars aligned."""
    label_width = max((len(s.label) for s in states), default=0)
    count_width = max((count_slot(s) for s in states), default=0)
    return [layout_line(s, width, label_width, count_width) for s in states]


def plain(segments: Sequence[Segment]) -> str:
    """The line's text."""
    return "".join(text for text, _ in segments)


def _crop(segments: list[Segment], width: int) -> list[Segment]:
    out: list[Segment] = []
    left = width
    for text, role in segments:
        if left <= 0:
            break
        out.append((text[:left], role))
        left -= len(text)
    return out

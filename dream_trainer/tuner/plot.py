"""A line chart as a PNG, drawn with Pillow (already a dependency, for logged images): no matplotlib.

Enough for the learning-rate finder's curve: a logarithmic or linear x axis with labelled ticks, a
linear y axis, the curve, and one highlighted point (the suggestion).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 72, 20, 34, 48
_GRID, _AXIS, _LINE, _MARK, _TEXT = (225, 225, 225), (40, 40, 40), (31, 119, 180), (214, 39, 40), (20, 20, 20)


def plot_curve(
    path: str | os.PathLike[str],
    xs: Sequence[float],
    ys: Sequence[float],
    *,
    log_x: bool,
    mark: int | None = None,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    size: tuple[int, int] = (640, 400),
) -> Path:
    """Draw `ys` against `xs` into the PNG at `path` (parents created) and return the path.

    Points whose value is not finite are left out. `mark` is the index of a point drawn as a red dot.
    """
    from PIL import Image, ImageDraw, ImageFont

    width, height = size
    if width < 200 or height < 150:
        raise ValueError(f"plot size={size!r} is too small: expected at least (200, 150) pixels")
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y) and (x > 0 or not log_x)]
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    left, top, right, bottom = _MARGIN_LEFT, _MARGIN_TOP, width - _MARGIN_RIGHT, height - _MARGIN_BOTTOM
    if title:
        draw.text((width / 2, 8), title, fill=_TEXT, font=font, anchor="ma")
    if x_label:
        draw.text(((left + right) / 2, height - 6), x_label, fill=_TEXT, font=font, anchor="md")
    if y_label:
        draw.text((6, top - 16), y_label, fill=_TEXT, font=font, anchor="la")
    if points:
        fx = math.log10 if log_x else float
        x_lo, x_hi = _span([fx(x) for x, _ in points])
        y_lo, y_hi = _span([y for _, y in points])

        def to_pixel(x: float, y: float) -> tuple[float, float]:
            px = left + (fx(x) - x_lo) / (x_hi - x_lo) * (right - left)
            py = bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)
            return px, py

        for value in _ticks(x_lo, x_hi, log_x):
            px = left + (value - x_lo) / (x_hi - x_lo) * (right - left)
            draw.line([(px, top), (px, bottom)], fill=_GRID)
            label = f"1e{round(value)}" if log_x else f"{value:.3g}"
            draw.text((px, bottom + 6), label, fill=_TEXT, font=font, anchor="ma")
        for value in _ticks(y_lo, y_hi, log=False):
            py = bottom - (value - y_lo) / (y_hi - y_lo) * (bottom - top)
            draw.line([(left, py), (right, py)], fill=_GRID)
            draw.text((left - 6, py), f"{value:.4g}", fill=_TEXT, font=font, anchor="rm")
        draw.line([to_pixel(x, y) for x, y in points], fill=_LINE, width=2)
        if mark is not None and 0 <= mark < len(xs) and math.isfinite(ys[mark]):
            px, py = to_pixel(xs[mark], ys[mark])
            draw.ellipse([px - 5, py - 5, px + 5, py + 5], outline=_MARK, width=2)
    draw.rectangle([left, top, right, bottom], outline=_AXIS)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, format="PNG")
    return out


def _span(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):  # one point, or a flat curve: give it some room
        pad = 0.5 if lo == 0 else abs(lo) * 0.05
        return lo - pad, hi + pad
    return lo, hi


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    """Tick positions inside [lo, hi]: each power of ten on a log axis (every k-th when there are many),
    about five round values on a linear one."""
    if log:
        powers = list(range(math.ceil(lo), math.floor(hi) + 1))
        step = max(1, math.ceil(len(powers) / 8))
        return [float(p) for p in powers[::step]]
    raw = (hi - lo) / 5
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]

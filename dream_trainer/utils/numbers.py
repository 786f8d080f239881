"""How metric values are written for people: the epoch summary and the progress display share it,
so the console shows the same digits everywhere."""

from __future__ import annotations


def format_metric(value: float) -> str:
    """Four significant digits; scientific notation below 1e-3 (a tiny loss stays readable)."""
    return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"


def join_to_width(parts: list[str], width: int | None, sep: str = " | ") -> str:
    """`sep.join(parts)`, broken into lines of at most `width` columns between parts (never inside
    one), continuation lines indented by two spaces: a terminal would otherwise wrap mid-name."""
    if width is None or width <= 0:
        return sep.join(parts)
    lines: list[str] = []
    line = ""
    for part in parts:
        candidate = part if not line else line + sep + part
        if line and len(candidate) > width:
            lines.append(line + sep.rstrip())
            line = "  " + part
        else:
            line = candidate
    lines.append(line)
    return "\n".join(lines)

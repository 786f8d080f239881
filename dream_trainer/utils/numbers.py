"""How metric values are written for people: the epoch summary and the progress display share it,
so the console shows the same digits everywhere."""

from __future__ import annotations


def format_metric(value: float) -> str:
    """Four significant digits; scientific notation below 1e-3 (a tiny loss stays readable)."""
    return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"

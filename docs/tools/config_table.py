"""Rewrite the configuration table in docs/guide.md from DreamTrainerConfig's field docstrings.

Run `python docs/tools/config_table.py` to rewrite it; with `--check` it only exits 1 when the table
is stale (the tests run this).
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "guide.md"
HEADER = "| field | type | default | meaning |\n|---|---|---|---|\n"
END = "\n\nA config holds plain values"


def table() -> str:
    from dream_trainer import config

    body = ast.parse(inspect.getsource(config.DreamTrainerConfig)).body[0].body  # type: ignore[attr-defined]
    rows = []
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign):
            continue
        default = ast.unparse(node.value) if node.value is not None else ""
        default = "[]" if default.startswith("field(") else default
        doc = ""
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            doc = " ".join(str(nxt.value.value).split())
        kind = ast.unparse(node.annotation).replace("|", "\\|")
        rows.append(f"| `{node.target.id}` | `{kind}` | `{default}` | {doc} |")  # type: ignore[union-attr]
    return HEADER + "\n".join(rows)


def render(text: str) -> str:
    start = text.index(HEADER)
    return text[:start] + table() + text[text.index(END, start) :]


if __name__ == "__main__":
    current = GUIDE.read_text()
    fresh = render(current)
    if "--check" in sys.argv:
        sys.exit(0 if fresh == current else 1)
    GUIDE.write_text(fresh)

"""Write docs/examples.md from the docstrings of examples/*.py (each script's first paragraph, its usage
lines, and its full source included with pymdownx.snippets).

    python docs/tools/examples_page.py          # rewrite
    python docs/tools/examples_page.py --check  # exit 1 if the page is stale

Scripts listed in ORDER come first, in that order; any other script follows alphabetically, so a new
example appears on the page as soon as this is run (tests/test_docs_snippets.py checks every script is
there).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "examples.md"
ORDER = [
    "classifier",
    "gan",
    "custom_loop",
    "trainer_guide",
    "torchmetrics_classifier",
    "ema",
    "char_lm",
    "resume_after_kill",
    "distributed",
    "gpt_2d",
    "cli_trainer",
]
TITLES = {
    "classifier": "Image classifier (the main job)",
    "gan": "GAN: two models, two optimizers",
    "custom_loop": "Custom training loop",
    "trainer_guide": "The Trainer Guide as a script",
    "torchmetrics_classifier": "torchmetrics",
    "ema": "EMA of the weights",
    "char_lm": "Character-level language model",
    "resume_after_kill": "Exact resume after SIGKILL",
    "distributed": "One process, DDP or FSDP",
    "gpt_2d": "2-D parallelism: a tiny GPT on a device mesh",
    "cli_trainer": "A trainer for the command line",
}


def render() -> str:
    names = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
    names = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
    docs = {n: ast.get_docstring(ast.parse((ROOT / "examples" / f"{n}.py").read_text())) or n for n in names}
    anchor = {n: n.replace("_", "-") for n in names}
    out = [
        "# Examples",
        "",
        "Every script in `examples/` runs on a CPU, generates its own data (nothing is downloaded) and takes",
        "command-line flags (`--help` lists them). Run them from the repository root. The sources below are",
        "included from the repository as they are.",
        "",
        "| script | what it shows |",
        "|---|---|",
    ]
    for n in names:
        first = " ".join(docs[n].split("\n\n")[0].split())
        out.append(f"| [`examples/{n}.py`](#{anchor[n]}) | {first} |")
    out.append("")
    for n in names:
        paragraphs = docs[n].split("\n\n")
        usage = [p for p in paragraphs if p.startswith("    ")]
        out += [f"## {TITLES.get(n, n)} {{#{anchor[n]}}}", "", " ".join(paragraphs[0].split()), ""]
        if usage:
            out += ["```bash", *[line[4:] for line in usage[0].splitlines()], "```", ""]
        out += [
            f'??? example "examples/{n}.py"',
            "",
            f"    <!-- not-runnable: the full source of examples/{n}.py, included from the repository: "
            f"a script, run as python examples/{n}.py -->",
            "    ```python",
            f'    --8<-- "examples/{n}.py"',
            "    ```",
            "",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    fresh = render()
    if "--check" in sys.argv:
        sys.exit(0 if PAGE.exists() and PAGE.read_text() == fresh else 1)
    PAGE.write_text(fresh)

"""Print the README's set-up commands, one per line, exactly as the README writes them.

They are the command lines of the first ```bash block under "## Two commands"; `.ci/run` runs each in a fresh
virtual environment, so what CI runs is what a new user copies.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(readme: Path = README) -> list[str]:
    text = readme.read_text()
    section = text.split("## Two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    if block is None:
        raise SystemExit("README.md: no ```bash block under '## Two commands'")
    lines = [line.strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


if __name__ == "__main__":
    sys.stdout.write("\n".join(commands()) + "\n")

"""Print a pip constraints file pinning every direct dependency of pyproject.toml to its lower bound.

`.ci/run` installs the package with these constraints in a second fresh virtual environment and runs the
test suite there, so each `>=` floor in pyproject.toml is one CI has run. Every requirement must carry a
`>=` bound (a requirement without one is an error here: its floor would be untested); an extra's requirement
that repeats a package keeps the highest floor.

    python .ci/lowest_constraints.py > lowest.txt && pip install -e ".[dev,docs]" -c lowest.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# name, optional [extras], then a `>=` bound (further clauses such as `,<3` may follow)
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def floors(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{normalised package name: lower bound} over the dependencies and every optional extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    found: dict[str, str] = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(
                f"pyproject.toml: {requirement!r} has no `>=` lower bound; give it one that CI can install"
            )
        name, version = re.sub(r"[-_.]+", "-", match.group(1)).lower(), match.group(2)
        if name not in found or _version_key(version) > _version_key(found[name]):
            found[name] = version
    return found


def main() -> None:
    for name, version in sorted(floors().items()):
        sys.stdout.write(f"{name}=={version}\n")


if __name__ == "__main__":
    main()

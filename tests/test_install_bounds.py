"""What CI installs: every dependency has a floor that `.ci/run` installs, the README's set-up commands are the
ones CI runs, and an older torch than the floor stops `import dream_trainer` with what to install."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from dream_trainer._torch_version import MIN_TORCH, check_torch

ROOT = Path(__file__).resolve().parents[1]


def _ci_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_requirement_has_a_floor_and_the_torch_floor_is_the_import_check() -> None:
    floors = _ci_script("lowest_constraints").floors()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    names = {re.sub(r"[-_.]+", "-", re.split(r"[\[>=<; ]", r)[0]).lower() for r in requirements}
    assert set(floors) == names
    assert floors["torch"] == ".".join(map(str, MIN_TORCH))
    assert project["requires-python"] == ">=3.11"


def test_a_requirement_without_a_floor_is_refused(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.13", "rich"]\n')
    with pytest.raises(SystemExit, match="'rich' has no `>=` lower bound"):
        _ci_script("lowest_constraints").floors(pyproject)


def test_ci_runs_the_readme_commands_as_written() -> None:
    commands = _ci_script("readme_commands").commands()
    assert commands == [
        "pip install torch==2.13.0 && pip install -e . && python examples/classifier.py",
        'pip install torch==2.13.0 && pip install -e ".[dev,docs]" && python -m pytest -n auto',
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python .ci/readme_commands.py" in ci and "python .ci/lowest_constraints.py" in ci
    assert ci.count("python -m pytest -n auto") == 1  # the lowest run; the latest run's is the README's own


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1", "2.15.0.dev20261101+cu130", "3.0.0"])
def test_a_supported_torch_passes(version: str) -> None:
    check_torch(version)


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.12.1", "1.13.1"])
def test_an_older_torch_is_refused_with_what_to_install(version: str) -> None:
    with pytest.raises(ImportError) as info:
        check_torch(version)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"dream_trainer needs torch>=2.13, found torch {version}: pip install 'torch>=2.13'")
    assert len(first) < 300


def test_import_with_an_older_torch_stops_at_the_import() -> None:
    code = "import torch; torch.__version__ = '2.6.0'; import dream_trainer"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-2].startswith("ImportError: dream_trainer needs torch>=2.13, found torch 2.6.0")

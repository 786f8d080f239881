"""Release shape: the wheel builds, installs into a fresh virtual environment, and runs the README quickstart.

The quickstart runs with the venv's Python from a directory outside the repository, so it imports the
installed wheel, never the checkout; the test checks that too (`dream_trainer.__file__` is inside the
venv, `py.typed` was packaged).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What a source checkout may hold that is not source: never copied into the build tree.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "site", "runs", "lightning_logs",
    ".pytest_cache", ".ruff_cache", ".whl", ".gl",
)  # fmt: skip


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _venv_python(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_runs_the_quickstart(tmp_path: Path) -> None:
    # 1. Build the wheel from a copy of the source tree: building in place would write build/ and
    #    *.egg-info into the checkout, and two builds at once (pytest -n) would trip over each other.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    wheels = tmp_path / "wheels"
    # --no-build-isolation: build with the setuptools already installed here instead of downloading a
    # fresh one into an isolated environment, so the test needs no network. The build backend is the
    # same (setuptools.build_meta, as pyproject.toml's [build-system] says).
    _run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
        cwd=tmp_path,
    )
    built = sorted(wheels.glob("dream_trainer-*.whl"))
    assert len(built) == 1, sorted(p.name for p in wheels.iterdir())
    wheel = built[0]

    # 2. A fresh virtual environment. --system-site-packages lets it see the torch, torchmetrics,
    #    tensorboard, ... installed for this Python, so nothing is downloaded again (torch alone is
    #    hundreds of MB) and the test runs offline. The wheel itself is installed into the venv with
    #    --no-deps; the venv's own site-packages comes first on sys.path, so `import dream_trainer`
    #    finds the wheel's copy, not an editable install of the checkout (asserted below).
    #    The venv gets no pip of its own (ensurepip takes ~10 s): the system pip, visible through
    #    --system-site-packages, installs into the venv when run by the venv's Python.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False, clear=True).create(env_dir)
    python = _venv_python(env_dir)
    if sys.prefix != sys.base_prefix:
        # This Python is itself a venv: --system-site-packages would expose the base interpreter's
        # packages, not this environment's. Add this environment's site-packages after the new venv's.
        purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
        lines = [f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()]
        (Path(purelib.strip()) / "_outer_environment.pth").write_text("\n".join(lines) + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)

    # 3. The README quickstart, from a directory outside the repository, with nothing pointing at it.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    readme = (ROOT / "README.md").read_text()
    quickstart = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]
    (outside / "quickstart.py").write_text(quickstart)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    out = _run([str(python), "quickstart.py"], cwd=outside, env=env)
    assert out.count("val_loss now") == 4, out  # the sanity check, then each of the 3 epochs
    assert "epoch 3/3" in out, out
    assert (outside / "runs" / "version_0" / "checkpoints" / "last.ckpt").is_file()

    # 4. What ran is the installed wheel.
    probe = (
        "import json, pathlib, dream_trainer; p = pathlib.Path(dream_trainer.__file__).resolve(); "
        "print(json.dumps({'file': str(p), 'typed': (p.parent / 'py.typed').is_file(), "
        "'version': dream_trainer.__version__}))"
    )
    info = json.loads(_run([str(python), "-c", probe], cwd=outside, env=env).strip().splitlines()[-1])
    installed = Path(info["file"])
    assert installed.is_relative_to(env_dir.resolve()), f"imported {installed}, not the venv's copy"
    assert not installed.is_relative_to(ROOT), installed
    assert info["typed"], "py.typed is missing from the wheel"
    assert wheel.name.startswith(f"dream_trainer-{info['version']}-"), (wheel.name, info["version"])

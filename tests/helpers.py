"""Plain test helpers shared by several test files (fixtures and the tiny trainer live in `conftest.py`).

Import them as ``from helpers import load_example, plain_config`` (``tests/`` has no ``__init__.py``, so
pytest puts it on ``sys.path``, as for ``conftest``):

- ``plain_config(tmp_path, **overrides)``: a ``DreamTrainerConfig`` on the cpu with no epoch summary and
  no sanity check, but the default loggers, progress bar and checkpointing (``quiet_config`` turns those off).
- ``LossRecorder``: a callback that collects the loss of every training step as a float.
- ``Hostile``: an object whose unpickling runs a shell command (creates a marker file).
- ``ckpt_dir(tmp_path, run="version_0")``: where `ModelCheckpoint` writes by default under ``root_dir=tmp_path``
  (in the run directory ``<root_dir>/<run>``; the first run of a root is ``version_0``).
- ``EXAMPLES``, ``load_example(name)``: the examples/ scripts, imported as modules.
- ``launcher_free_env()``, ``torchrun(*args)``, ``python()``, ``process_tree(pid)``: launching child processes
  and torchrun (forked from the suite's zygote, ``tests/zygote.py``, where one runs) and finding them.
- ``run_python_forked(*args, timeout=...)``: ``python args`` (a script, ``-m module`` or ``-c code``) as
  ``subprocess.run`` gives it, in a process that starts with torch and dream_trainer imported (forked from
  the zygote, a server that imported them and ran nothing else): ~5 s of CPU less per process.
- ``start_python_forked(*args, out=..., err=...)``: the same, without waiting (a ``ForkedPython`` is returned).
- ``file_lock(path)``, ``xdist_shared_dir(tmp_path_factory, name)``: sharing work between xdist workers;
  ``torchrun_once(...)``: one launch per test run; ``four_rank_launch(...)``: the 4-process launch that
  test_meta_memory, test_parallel_blocks and test_model_parallel share.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dream_trainer import Callback, DreamTrainerConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


# --- configs and callbacks ------------------------------------------------------------------------------
def plain_config(tmp_path: Any, **overrides: Any) -> DreamTrainerConfig:
    """cpu, no epoch summary, no sanity check, `root_dir=tmp_path`; every other field its default."""
    kwargs: dict[str, Any] = {
        "device": "cpu",
        "print_epoch_summary": False,
        "num_sanity_val_steps": 0,
        "root_dir": str(tmp_path),
    }
    kwargs.update(overrides)
    return DreamTrainerConfig(**kwargs)


class LossRecorder(Callback):
    """The loss of every training step, as floats, in order (from `on_train_batch_end`)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"].detach()))


# --- checkpoints ----------------------------------------------------------------------------------------
class Hostile:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def ckpt_dir(tmp_path: Path, run: str = "version_0") -> Path:
    """`<root_dir>/<run>/checkpoints`: ModelCheckpoint's default directory (the first run's by default)."""
    return tmp_path / run / "checkpoints"


# --- examples and child processes -----------------------------------------------------------------------
def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py (examples/ is a folder of scripts, not a package)."""
    module_name = f"example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


_LAUNCHER_VARS = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    | {"ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"}
)


def launcher_free_env() -> dict[str, str]:
    """This environment minus anything a surrounding torchrun set, so a child process is never taken for a rank."""
    return {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}


def python() -> str:
    """The `python` to start a test's script with (`[python(), "script.py", ...]`): the suite's zygote client
    (`tests/zygote.py`) where one runs, else this interpreter. The script then runs in a process forked from a
    server that imported torch and dream_trainer; the process the test holds stands in for it (signals pass
    on; it ends as the script ended; `zygote.forked_child(pid)` is the script's pid). Not for a test about what
    a fresh interpreter imports."""
    import zygote

    return zygote.client() or sys.executable


def torchrun(*launcher_args: str, forked: bool = True) -> list[str]:
    """`torchrun` as a module of this interpreter (the same torch as the tests). Under the suite's zygote
    (`tests/zygote.py`: its ranks are forked from a server that imported torch) the agent is forked from it
    too, unless `forked=False`: a test that finds the ranks among the agent's child processes needs the real
    agent (its children are then the ranks' stand-ins, which pass signals on and die with their rank)."""
    return [python() if forked else sys.executable, "-m", "torch.distributed.run", *launcher_args]


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it, parents first (Linux `/proc`). A rank forked by the suite's zygote
    (`tests/zygote.py`) counts as the child of the process that stands in for it (torchrun's child)."""
    import zygote

    pids, i = [pid], 0
    while i < len(pids):
        children = Path(f"/proc/{pids[i]}/task/{pids[i]}/children")
        with contextlib.suppress(OSError):
            pids += [int(p) for p in children.read_text().split()]
        forked = zygote.forked_child(pids[i])
        if forked is not None:
            pids.append(forked)
        i += 1
    return pids


def _zygote_env(env: dict[str, str] | None) -> dict[str, str]:
    import zygote

    return zygote.carried(dict(os.environ if env is None else env))


def run_python_forked(
    *args: str, timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)`
    (`script.py ...`, `-m module ...` or `-c code ...`), the process forked from the suite's zygote
    (`tests/zygote.py`: a server that imported torch and dream_trainer once) instead of importing them again.
    The environment gets the zygote's two variables where `env` lacks them. Without a zygote (a run that turned
    it off), it is the real interpreter."""
    cmd = [python(), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_zygote_env(env), cwd=cwd)


class ForkedPython:
    """A `python` started by `start_python_forked`: `pid` (the process the test holds), `kill()` (SIGKILL to the
    script's own process), `join(timeout)` and `exitcode` (None while it runs; negative: the signal that ended
    it), as `multiprocessing.Process` has them."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    def kill(self) -> None:
        import zygote

        with contextlib.suppress(ProcessLookupError):
            os.kill(zygote.forked_child(self.pid) or self.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()


def start_python_forked(
    *args: str, out: Path, err: Path, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> ForkedPython:
    """`python *args` started as `run_python_forked` starts it (forked from the suite's zygote), without waiting;
    its stdout and stderr go to the files `out` and `err`."""
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        popen = subprocess.Popen(
            [python(), *map(str, args)], stdout=stdout, stderr=stderr, env=_zygote_env(env), cwd=cwd
        )
    return ForkedPython(popen)


# --- sharing work between xdist workers -----------------------------------------------------------------
@contextlib.contextmanager
def nothing_frozen() -> Iterator[None]:
    """The cyclic collector with nothing frozen, as in a user's process, for the block: the suite's workers
    froze what their collection made (conftest's `pytest_collection_finish`), which the trainer would take
    for objects its user froze. Frozen again after the block."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock shared by the xdist workers of this test run (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def xdist_shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory shared by the xdist workers of this test run (never across runs), created."""
    base = tmp_path_factory.getbasetemp()
    run_uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    directory = base.parent / f"{name}-{run_uid}" if run_uid else base / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def torchrun_once(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    worker: Path,
    nproc: int,
    timeout: float,
    args: Sequence[str] = (),
) -> tuple[Path, Path]:
    """Launch `torchrun --nproc_per_node nproc worker --out-dir DIR *args` once per test run, whichever
    xdist worker asks first (the others wait on the lock, then read the same results). Returns `(DIR, log)`;
    the log holds the exit code, the wall time and the tails of stdout/stderr."""
    shared = xdist_shared_dir(tmp_path_factory, name)
    out_dir, log = shared / "out", shared / "launch.log"
    with file_lock(shared / "lock"):
        if not (shared / "done").exists():
            out_dir.mkdir(exist_ok=True)
            env = {**launcher_free_env(), "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
            start = time.monotonic()
            cmd = [
                *torchrun("--standalone", "--nproc_per_node", str(nproc)),
                str(worker),
                "--out-dir",
                str(out_dir),
                *args,
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
                head, stdout, stderr = f"exit code {proc.returncode}", proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as exc:  # what it printed until then: the log says where it was
                head = f"timed out ({timeout:.0f} s)"
                stdout, stderr = (_text(exc.output), _text(exc.stderr))
            took = time.monotonic() - start
            log.write_text(f"{head} after {took:.1f} s\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}")
            (shared / "done").touch()
    return out_dir, log


def four_rank_launch(tmp_path_factory: pytest.TempPathFactory, part: str) -> tuple[Path, Path]:
    """The one `torchrun --nproc_per_node 4` launch of `four_rank_worker.py` per test run (meta_memory,
    then parallel_blocks, then model_parallel in the same 4 processes), whichever test file asks first.
    Returns `(DIR/<part>, log)`: that part's output folder and the launch's log."""
    worker = Path(__file__).with_name("four_rank_worker.py")
    out_dir, log = torchrun_once(tmp_path_factory, "four-ranks", worker, 4, timeout=600)
    return out_dir / part, log


# --- what the file loggers wrote, as series ---------------------------------------------------------------
def csv_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """`run_dir/metrics.csv` (CSVLogger) as `{metric: [(step, value), ...]}`, in file order."""
    import csv

    series: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key != "step" and value:
                    series.setdefault(key, []).append((int(row["step"]), float(value)))
    return series


def jsonl_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """`run_dir/metrics.jsonl` (JSONLogger) as `{metric: [(step, value), ...]}`, in file order; empty when
    the file is missing."""
    series: dict[str, list[tuple[int, float]]] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        for key, value in row.items():
            if key != "step":
                series.setdefault(key, []).append((int(row["step"]), float(value)))
    return series

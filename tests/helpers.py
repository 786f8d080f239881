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
- ``launcher_free_env()``, ``torchrun(*args)``: launching child processes and torchrun.
- ``run_script_forked(script, *args, timeout=...)``: ``python script args`` in a process that starts with
  torch and dream_trainer imported (forked from a server that imported them), saving ~3 s of CPU each.
- ``file_lock(path)``, ``xdist_shared_dir(tmp_path_factory, name)``: sharing work between xdist workers;
  ``torchrun_once(...)``: one launch per test run; ``four_rank_launch(...)``: the 4-process launch that
  test_meta_memory, test_parallel_blocks and test_model_parallel share.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
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


def torchrun(*launcher_args: str) -> list[str]:
    """`torchrun` as a module of this interpreter (the same torch as the tests)."""
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args]


# Imported once by the fork server, so that a forked script starts with them (~3 s of CPU per process).
FORK_PRELOAD = ("torch", "torch._dynamo", "torch.utils.data", "dream_trainer", "dream_trainer.callbacks", "helpers")


def run_script_forked(
    script: Path, *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python script *args` as `subprocess.run(..., capture_output=True, text=True, timeout=timeout, env=env)`
    gives it, in a new process that starts with torch, torch._dynamo and dream_trainer already imported.

    The process is forked from a server (multiprocessing's forkserver, one per test process, started on
    first use) that imported `FORK_PRELOAD` and ran nothing else: no torch op, no thread pool, no RNG
    draw, so the child is the process a fresh `python script` would be once its imports are done. It
    runs the script as `__main__` with `sys.argv = [script, *args]`, this process's current directory
    and `env` (default: this process's environment; variables torch reads at import come from the
    server's start), runs the atexit
    handlers at a normal exit as the interpreter would, and gives back the exit status (negative: the
    signal that ended it, -9 for SIGKILL), stdout and stderr. On timeout it is killed and
    `subprocess.TimeoutExpired` raised. Where forkserver is missing (Windows), it is `subprocess.run`."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():  # pragma: no cover - Windows
        cmd = [sys.executable, str(script), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORK_PRELOAD))  # used when this process starts its server (first call)
    with contextlib.ExitStack() as stack:
        import tempfile

        outputs = [Path(stack.enter_context(tempfile.TemporaryDirectory())) / name for name in ("out", "err")]
        argv = [str(script), *args]
        environ = dict(os.environ if env is None else env)
        proc = ctx.Process(target=_forked_script, args=(argv, environ, *map(str, outputs)))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
        out, err = (p.read_text(errors="replace") if p.exists() else "" for p in outputs)
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=out, stderr=err)
    assert proc.exitcode is not None
    return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode, out, err)


def _forked_script(argv: list[str], environ: dict[str, str], out: str, err: str) -> None:
    """In the forked child: what `python argv[0] argv[1:]` does after its imports."""
    import atexit
    import runpy

    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script` puts its folder first
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, which skips them


# --- sharing work between xdist workers -----------------------------------------------------------------
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


def torchrun_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, worker: Path, nproc: int, timeout: float
) -> tuple[Path, Path]:
    """Launch `torchrun --nproc_per_node nproc worker --out-dir DIR` once per test run, whichever xdist
    worker asks first (the others wait on the lock, then read the same results). Returns `(DIR, log)`;
    the log holds the exit code, the wall time and the tails of stdout/stderr."""
    shared = xdist_shared_dir(tmp_path_factory, name)
    out_dir, log = shared / "out", shared / "launch.log"
    with file_lock(shared / "lock"):
        if not (shared / "done").exists():
            out_dir.mkdir(exist_ok=True)
            env = {**launcher_free_env(), "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
            start = time.monotonic()
            cmd = [*torchrun("--standalone", "--nproc_per_node", str(nproc)), str(worker), "--out-dir", str(out_dir)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            log.write_text(
                f"exit code {proc.returncode} after {time.monotonic() - start:.1f} s\n"
                f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
            )
            (shared / "done").touch()
    return out_dir, log


def four_rank_launch(tmp_path_factory: pytest.TempPathFactory, part: str) -> tuple[Path, Path]:
    """The one `torchrun --nproc_per_node 4` launch of `four_rank_worker.py` per test run (meta_memory,
    then parallel_blocks, then model_parallel in the same 4 processes), whichever test file asks first.
    Returns `(DIR/<part>, log)`: that part's output folder and the launch's log."""
    worker = Path(__file__).with_name("four_rank_worker.py")
    out_dir, log = torchrun_once(tmp_path_factory, "four-ranks", worker, 4, timeout=600)
    return out_dir / part, log

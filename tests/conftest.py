"""Shared test helpers for dream_trainer.

Import them in test files as ``from conftest import TinyTrainer, make_regression_data, quiet_config``
(``tests/`` has no ``__init__.py``, so pytest puts it on ``sys.path``; this works under ``pytest -n``).

Helpers here are kept small and stable because several test files use them:

- ``make_regression_data(n=256, seed=0, scale=1.0)`` -> ``(x, y)`` with ``x: (n, 4)``, ``y: (n, 1)``, a noisy
  linear target (times ``scale``).
- ``quiet_config(tmp_path=None, **overrides)`` -> a ``DreamTrainerConfig`` with ``print_epoch_summary=False``,
  ``device="cpu"``, ``num_sanity_val_steps=0`` and ``root_dir=tmp_path`` (when given), plus your overrides.
- ``TinyTrainer(config, n_train=16, n_val=8, batch_size=4, lr=0.1)``: ``self.model = nn.Linear(4, 1)``, SGD,
  ``configure_dataloaders`` returns TensorDataset loaders (train not shuffled, so runs are deterministic),
  ``training_step`` returns ``{"loss": mse}``, ``validation_step`` returns ``{"val_loss": mse}``.
  With the defaults an epoch has 4 train batches and validation has 2 batches.
- ``RecordingCallback``: records ``(hook_name, args)`` for every hook in ``dream_trainer.callbacks.HOOKS``.
- Fixtures: ``regression_data``; ``restore_torch_threads`` (puts torch's thread count back after the test);
  ``one_torch_thread`` (torch on one thread for the test).

Plain helpers that are not about the tiny trainer (configs with the default loggers, example loading,
torchrun launching, xdist locks) are in ``helpers.py``.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import TYPE_CHECKING, Any

import pytest
import zygote

if TYPE_CHECKING:
    import torch
    from tiny import RecordingCallback, TinyTrainer, make_regression_data, quiet_config

# Every process the suite starts ends with it: a run that leaves one fails (tests/process_check.py).
pytest_plugins = ["process_check"]

__all__ = ["RecordingCallback", "TinyTrainer", "make_regression_data", "quiet_config"]


def __getattr__(name: str) -> Any:
    """`from conftest import TinyTrainer` (and the rest of `__all__`): from `tiny.py`, imported on first use, so
    that xdist's controller, which loads this file but runs no test, never imports torch."""
    if name in __all__:
        import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module 'conftest' has no attribute {name!r}")


@pytest.fixture
def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """`make_regression_data()` as a fixture."""
    from tiny import make_regression_data

    return make_regression_data()


@pytest.fixture
def restore_torch_threads():
    """Gives the worker its torch thread count back (the examples' main() sets it: --threads, default 1)."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test, then the worker's count back: bitwise comparisons with a
    hand-written loop need the same kernels in both."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _run_in_tmp_dir(tmp_path, monkeypatch):
    """Every test runs in its own directory, so default `root_dir="runs"` outputs never land in the repo."""
    monkeypatch.chdir(tmp_path)


# --- scheduling under pytest-xdist -------------------------------------------------------------------------
# `pytest -n auto` runs with `--dist loadgroup` (pyproject's addopts): each xdist worker takes the next unit
# of work when it is nearly idle, a unit being one test or every test of one group below, in the order
# `pytest_collection_modifyitems` leaves them (the groups, then the other slow tests, then the rest).
#
# A group is the tests that share one expensive thing made once per test run (a torchrun launch, a
# server, a benchmark run): on one worker they run one after the other, where spread over two workers
# the second would wait on the first one's lock (or, for a module-scoped fixture, make it a second time)
# instead of running other tests meanwhile. Listed longest first: the longest chains start first.
SHARED_LAUNCH_GROUPS = {
    # module -> (the fixture its sharing tests use, or None for all its tests; the group)
    "test_benchmark_suite.py": ("quick_run", "benchmark-suite"),  # the --quick suite: ~20 processes in turn
    "test_distributed.py": ("single", "distributed"),  # 7 torchrun launches, some feeding the next
    "test_spikes_ddp.py": ("main", "distributed"),  # cases of test_distributed.py's `main` launch
    "test_meta_memory.py": ("ranks", "four-ranks"),  # } one torchrun launch of 4 processes
    "test_parallel_blocks.py": ("dist_results", "four-ranks"),  # } for the three modules
    "test_model_parallel.py": ("mp_results", "four-ranks"),  # } (helpers.four_rank_launch)
    "test_logger_mlflow.py": ("server", "mlflow-server"),  # a tracking server per module and worker
    "test_logger_resume_trackers.py": ("server", "mlflow-server"),
    "test_logger_mlflow_store.py": (None, "mlflow-server"),  # every test: the worker that imported mlflow
    "test_data_resume_ranks.py": ("two_ranks", "data-resume-ranks"),  # one torchrun launch
    "test_gan_scoping.py": ("launched", "gan-scoping"),  # one torchrun launch
    "test_slurm.py": ("slurm", "slurm"),  # one slurmctld + slurmd per test run, its jobs (~65-80 s)
}
_GROUP_RANK = {group: i for i, group in enumerate(dict.fromkeys(g for _, g in SHARED_LAUNCH_GROUPS.values()))}


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: one worker more than the CPUs this process may use. Much of the slow tests' time is
    waiting (torchrun rendezvous and ranks waiting on each other, process-group timeouts, benchmark and
    example processes run one after the other, servers starting), and a spare worker runs other tests
    meanwhile: on 2 cores, the slow tests take ~250 s with 3 workers, ~350 s with 2 and ~260 s with 4. (With
    the workers forked from the zygote, 4 workers took 414 s for the whole suite and 3 took 433 s, once each:
    within what runs of one tree differ by here, 403-431 s, so the count stays.)"""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or config.option.numprocesses == "logical":
        return None  # xdist's own answer: the variable's value, or the logical CPUs
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus + 1


@pytest.hookimpl(trylast=True)  # after tests/process_check.py marks the environment the zygote inherits
def pytest_configure(config: pytest.Config) -> None:
    # xdist >= 3.6 would sort the loadgroup units by their number of tests; keep the order set below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # A command the suite runs by name (`python`, `torchrun`, `dream-trainer`: as the docs' Slurm job does) is
    # this interpreter's, however pytest was started (`<venv>/bin/python -m pytest` leaves PATH without the venv).
    bin_dir = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    # With PYTHONDONTWRITEBYTECODE set, each xdist worker compiled and assertion-rewrote every test module again
    # at each run (~8 s of CPU per worker, while all of them start at once). This process writes its bytecode
    # into the source tree's __pycache__ folders (git ignores them), as Python does by default; the processes
    # the tests start keep the setting they inherit.
    sys.dont_write_bytecode = False
    # The Python processes the tests start fork from a server that imported torch once (tests/zygote.py): ~5 s
    # of CPU less each. One server for the run, started by its first process (xdist's controller, or pytest
    # itself without -n): the workers inherit its variables. It starts now, importing while the workers start.
    if zygote.ENV_SOCKET not in os.environ and sys.platform == "linux":
        zygote.start()
        # xdist's workers too: each would import torch, torch._dynamo and dream_trainer again (~6 s of CPU, all
        # at once, before the first test). xdist starts them after this hook, from `tx` ("popen" per worker).
        tx = getattr(config.option, "tx", None) or []
        if tx and all(spec == "popen" for spec in tx):
            config.option.tx = [f"popen//python={os.environ['PYTHON_EXEC']}" for _ in tx]
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        # A process that runs tests: the first optimizer it builds imports torch._dynamo (~3 s). Imported here,
        # so that the cost is not charged to whichever test happens to run first.
        import torch._dynamo  # noqa: F401


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and the collection made (~700k objects: torch, the test modules, their parameters)
    lives until the end of the run: out of the cyclic collector's sight (gc.freeze), each full collection during
    the run, and pytest's five at its end (~0.4 s each, and more as the run goes on), walks only what the tests
    made since."""
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    zygote.stop()  # this process's (if it started one), before tests/process_check.py looks for what outlived the run


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups first (in `SHARED_LAUNCH_GROUPS`'s order), then the other slow tests, then the rest, each
    in collection order (a stable sort): the long chains start first, and the last tests to start are
    short ones, so that no worker is left alone with a long test at the end."""
    rank: dict[str, int] = {}
    for item in items:
        shared = SHARED_LAUNCH_GROUPS.get(item.path.name)
        if shared is not None and (shared[0] is None or shared[0] in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(shared[1]))
            rank[item.nodeid] = _GROUP_RANK[shared[1]]
        else:
            rank[item.nodeid] = len(_GROUP_RANK) + (item.get_closest_marker("slow") is None)
    items.sort(key=lambda item: rank[item.nodeid])

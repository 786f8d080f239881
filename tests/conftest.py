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

import os
import sys
from typing import Any

import pytest
import torch

# The first optimizer a process builds imports torch._dynamo (~3 s). Import it at collection so that
# cost is not charged to whichever test happens to run first on each xdist worker.
import torch._dynamo
import torch.nn.functional as F
import zygote
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import HOOKS

# Every process the suite starts ends with it: a run that leaves one fails (tests/process_check.py).
pytest_plugins = ["process_check"]

__all__ = ["RecordingCallback", "TinyTrainer", "make_regression_data", "quiet_config"]


def make_regression_data(n: int = 256, seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression problem: `y = (x @ w + 0.5 + noise) * scale`, `x: (n, 4)`, `y: (n, 1)`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    y = x @ w + 0.5 + 0.01 * torch.randn(n, 1, generator=g)
    if scale != 1.0:
        y = y * scale
    return x, y


def quiet_config(tmp_path: Any = None, **overrides: Any) -> DreamTrainerConfig:
    """A `DreamTrainerConfig` for tests: cpu, no epoch summary, no sanity check, `root_dir=tmp_path`,
    and none of the defaults that write or print (TensorBoard, progress, checkpointing)."""
    kwargs: dict[str, Any] = {
        "print_epoch_summary": False,
        "device": "cpu",
        "num_sanity_val_steps": 0,
        "loggers": [],
        "enable_progress_bar": False,
        "enable_checkpointing": False,
    }
    if tmp_path is not None:
        kwargs["root_dir"] = str(tmp_path)
    kwargs.update(overrides)
    return DreamTrainerConfig(**kwargs)


class TinyTrainer(DreamTrainer):
    """The smallest complete trainer: a linear regression with SGD.

    `n_train`/`n_val` samples, `batch_size` per batch; `n_val=0` means no validation loader.
    `self.train_losses` collects the detached loss of every `training_step` call, in order.
    """

    def __init__(
        self,
        config: DreamTrainerConfig,
        n_train: int = 16,
        n_val: int = 8,
        batch_size: int = 4,
        lr: float = 0.1,
        data_seed: int = 0,
    ) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.lr = lr
        self.n_train = n_train
        self.n_val = n_val
        self.batch_size = batch_size
        self.data_seed = data_seed
        self.train_losses: list[torch.Tensor] = []

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader | None]:
        x, y = make_regression_data(self.n_train + self.n_val, seed=self.data_seed)
        train = DataLoader(TensorDataset(x[: self.n_train], y[: self.n_train]), batch_size=self.batch_size)
        val = None
        if self.n_val:
            val = DataLoader(TensorDataset(x[self.n_train :], y[self.n_train :]), batch_size=self.batch_size)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.train_losses.append(loss.detach().clone())
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def _make_recorder(hook: str):
    def record(self: RecordingCallback, trainer: DreamTrainer, *args: Any) -> None:
        self.calls.append((hook, args))

    record.__name__ = hook
    return record


class RecordingCallback(Callback):
    """Overrides every hook in `HOOKS`; `calls` is a list of `(hook_name, args_without_trainer)`,
    `names` just the hook names in firing order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


for _hook in HOOKS:
    setattr(RecordingCallback, _hook, _make_recorder(_hook))
del _hook


@pytest.fixture
def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """`make_regression_data()` as a fixture."""
    return make_regression_data()


@pytest.fixture
def restore_torch_threads():
    """Gives the worker its torch thread count back (the examples' main() sets it: --threads, default 1)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test, then the worker's count back: bitwise comparisons with a
    hand-written loop need the same kernels in both."""
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
    # module -> (the fixture its sharing tests use, the group)
    "test_benchmark_suite.py": ("quick_run", "benchmark-suite"),  # the --quick suite: ~20 processes in turn
    "test_distributed.py": ("single", "distributed"),  # 7 torchrun launches, some feeding the next
    "test_spikes_ddp.py": ("main", "distributed"),  # cases of test_distributed.py's `main` launch
    "test_meta_memory.py": ("ranks", "four-ranks"),  # } one torchrun launch of 4 processes
    "test_parallel_blocks.py": ("dist_results", "four-ranks"),  # } for the three modules
    "test_model_parallel.py": ("mp_results", "four-ranks"),  # } (helpers.four_rank_launch)
    "test_logger_mlflow.py": ("server", "mlflow-server"),  # a tracking server per module and worker
    "test_logger_resume_trackers.py": ("server", "mlflow-server"),
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
    meanwhile: on 2 cores, the slow tests take ~250 s with 3 workers, ~350 s with 2 and ~260 s with 4."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or config.option.numprocesses == "logical":
        return None  # xdist's own answer: the variable's value, or the logical CPUs
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus + 1


def pytest_configure(config: pytest.Config) -> None:
    # xdist >= 3.6 would sort the loadgroup units by their number of tests; keep the order set below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # A command the suite runs by name (`python`, `torchrun`, `dream-trainer`: as the docs' Slurm job does) is
    # this interpreter's, however pytest was started (`<venv>/bin/python -m pytest` leaves PATH without the venv).
    bin_dir = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    # torchrun's ranks fork from a server that imported torch once (tests/zygote.py): ~5 s of CPU less per rank.
    # Started here, in each process that runs tests (not xdist's controller), so it is ready by the first launch.
    runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    if runs_tests and zygote.ENV_SOCKET not in os.environ and sys.platform == "linux":
        zygote.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    zygote.stop()  # before tests/process_check.py looks for what outlived the run (it runs last)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups first (in `SHARED_LAUNCH_GROUPS`'s order), then the other slow tests, then the rest, each
    in collection order (a stable sort): the long chains start first, and the last tests to start are
    short ones, so that no worker is left alone with a long test at the end."""
    rank: dict[str, int] = {}
    for item in items:
        shared = SHARED_LAUNCH_GROUPS.get(item.path.name)
        if shared is not None and shared[0] in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(shared[1]))
            rank[item.nodeid] = _GROUP_RANK[shared[1]]
        else:
            rank[item.nodeid] = len(_GROUP_RANK) + (item.get_closest_marker("slow") is None)
    items.sort(key=lambda item: rank[item.nodeid])
